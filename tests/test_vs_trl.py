"""experiments/vs_trl.py: both systems get the recipe's setting (with the script's overrides), and bad flags
end with a one-line error. The experiment itself (two trainings on SmolLM2) takes tens of minutes on a
CPU, far over a test's budget: its numbers are in docs/experiments/vs_trl.md."""

import json
from pathlib import Path

import gin
import pytest

from experiments import vs_trl as vs_trl_module


@pytest.fixture
def vs_trl():
    gin.clear_config()
    yield vs_trl_module
    gin.clear_config()


def test_setting_is_the_recipe_with_the_overrides(vs_trl):
    args = vs_trl.parse_args(["--steps", "2", "--eval_size", "4", "--n_samples", "4", "--max_tokens", "32",
                              "--ours_learner", "fp32"])
    s = vs_trl.load_setting(args)   # converts the SmolLM2 GGUF when the checkpoint is missing (seconds)
    # from gin/recipes/smollm2_arith_fp8.gin
    assert (s["prompts_per_step"], s["mini_batch_size"], s["temperature"]) == (8, 4, 0.6)
    assert (s["learning_rate"], s["warmup_steps"], s["overlong_buffer"]) == (5e-5, 3, 0)
    assert s["quantization"] == "fp8_per_channel" and s["chat_template"] is True
    assert s["model_path"].endswith("checkpoints/smollm2-135m-instruct")
    assert (Path(s["model_path"]) / "config.json").exists()
    # the overrides, for both systems
    assert (s["n_samples"], s["max_tokens"]) == (4, 32)
    assert len(s["task"].eval_examples()) == 4 and s["task"].reward == "final_number"
    assert "--gin.MAX_RESPONSE_TOKENS=32" in vs_trl.gin_bindings(args)
    # ours at its best on a CPU (unquantized rollouts, fp32 math on the served bf16 params); or the recipe as is
    assert vs_trl.ours_bindings(args) == ["--gin.QUANTIZATION=None", "--gin.rl.PrecisionConfig.param_dtype='bfloat16'",
                                          "--gin.rl.PrecisionConfig.compute_dtype='float32'"]
    assert vs_trl.ours_bindings(vs_trl.parse_args(["--ours_rollouts", "fp8", "--ours_learner", "recipe"])) == []
    assert vs_trl.ours_bindings(vs_trl.parse_args(["--ours_rollouts", "fp8", "--ours_learner", "recipe",
                                                   "--ours_remat", "none"])) == ["--gin.learner_jax.MemoryConfig.remat='none'"]
    blockwise = vs_trl.parse_args(["--ours_learner", "recipe", "--ours_gin", "learner_jax.MemoryConfig.attention_impl='blockwise'"])
    assert vs_trl.ours_bindings(blockwise) == ["--gin.QUANTIZATION=None", "--gin.learner_jax.MemoryConfig.attention_impl='blockwise'"]


@pytest.mark.parametrize("argv, fix", [
    (["--steps", "0"], "--steps=0 must be >= 1"),
    (["--eval_size", "-1"], "--eval_size=-1 must be >= 1"),
    (["--n_samples", "0"], "--n_samples=0 must be >= 1"),
    (["--skip_ours", "--skip_trl"], "drop one"),
    (["--skip_ours", "--reuse_ours"], "drop one"),
    (["--skip_trl", "--reuse_trl"], "drop one"),
    (["--ours_gin", "remat"], "is not NAME=VALUE"),
])
def test_bad_flags_end_with_one_line(vs_trl, argv, fix):
    with pytest.raises(SystemExit) as e:
        vs_trl.parse_args(argv)
    assert fix in str(e.value) and "\n" not in str(e.value)


def test_reuse_ours_reads_the_first_n_steps_and_needs_their_checkpoint(vs_trl, tmp_path):
    run = tmp_path / "ours"
    (run / "checkpoints" / "2").mkdir(parents=True)
    rows = [{"step": 0, "accuracy/heldout": 0.25}] + [
        {"step": k, "time/step": 10.0 * k, "time/generate": 1.0, "reward/mean": 0.5,
         "dynamic_sampling/kept_groups": 2} for k in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = vs_trl.run_ours(vs_trl.parse_args(["--reuse_ours", "--steps", "2"]), tmp_path, None)
    assert r["step_seconds"] == [10.0, 20.0] and r["wall_s"] is None and r["heldout_step0_own_engine"] == 0.25
    with pytest.raises(SystemExit, match="a checkpoint at 3") as e:  # 3 steps logged, no checkpoint at 3
        vs_trl.run_ours(vs_trl.parse_args(["--reuse_ours", "--steps", "3"]), tmp_path, None)
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="run without --reuse_ours"):
        vs_trl.run_ours(vs_trl.parse_args(["--reuse_ours"]), tmp_path / "elsewhere", None)


def test_reuse_trl_compares_a_cut_run_at_its_snapshot(vs_trl, tmp_path):
    run = tmp_path / "trl"
    (run / "step5").mkdir(parents=True)
    (run / "steps.jsonl").write_text("".join(json.dumps({"step": k, "seconds": 100.0 + k}) + "\n" for k in range(1, 8)))
    r = vs_trl.reuse_trl(vs_trl.parse_args(["--reuse_trl", "--steps", "5"]), tmp_path)
    assert r["step_seconds"] == [101.0, 102.0, 103.0, 104.0, 105.0] and r["reused"] == "cut run"
    assert r["weights_dir"] == str(run / "step5") and r["mean_step_s_after_first"] == 103.5
    with pytest.raises(SystemExit, match="no weights at step 7") as e:  # timed, but cut before final/
        vs_trl.reuse_trl(vs_trl.parse_args(["--reuse_trl", "--steps", "7"]), tmp_path)
    assert "\n" not in str(e.value)
    # a finished 7-step run: final/ is the weights at step 7, its logged rewards come along
    (run / "final").mkdir()
    (run / "result.json").write_text(json.dumps({"train_reward_mean": [0.1] * 7, "per_device_batch": 8}))
    r = vs_trl.reuse_trl(vs_trl.parse_args(["--reuse_trl", "--steps", "7"]), tmp_path)
    assert r["weights_dir"] == str(run / "final") and r["train_reward_mean"] == [0.1] * 7
    assert r["per_device_batch"] == 8 and r["reused"] == "finished run"


def test_prompts_not_a_multiple_of_the_mini_batch_name_the_fix(vs_trl):
    with pytest.raises(ValueError, match="multiple of mini_batch_size"):
        vs_trl.load_setting(vs_trl.parse_args(["--prompts_per_step", "6"]))


def test_trl_precision_auto_follows_the_cpu_and_names_itself(vs_trl, monkeypatch):
    from portable_rl.engines import cpu_features
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": {"avx512f", "avx512_bf16"})
    assert vs_trl.parse_args([]).trl_precision == "bf16_autocast" and vs_trl.parse_args([]).ours_learner == "recipe"
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": {"avx2"})
    assert vs_trl.parse_args([]).trl_precision == "fp32" and vs_trl.parse_args([]).ours_learner == "fp32"
    assert vs_trl.parse_args(["--trl_precision", "bf16"]).trl_precision == "bf16"  # an explicit choice wins
    d = vs_trl.trl_description(False, "bf16_autocast")
    assert d["trl_precision"] == "bf16_autocast" and "bf16 autocast" in d["learner"] and "bf16" in d["rollouts"]
    assert vs_trl.TRL_PRECISIONS["bf16"][:2] == ("bfloat16", True)
