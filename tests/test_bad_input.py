"""Bad input, tried as a new user would: each gives one line naming the fix, or a counted skip (issue 6).

The issue's checklist → tests (here unless a file is named):
- unknown engine name:           tests/test_registry.py::test_unknown_engine_lists_known_ones,
                                 test_cli_bad_input_ends_with_one_line[engine]
- unknown task / reward name:    test_cli_bad_input_ends_with_one_line[task, reward],
                                 tests/test_tasks.py::test_rewards_registry_and_scoring
- gin binding to a missing param: tests/test_gin.py::test_cli_errors_are_one_clear_line,
                                 test_unknown_parameter_names_the_close_match_or_the_valid_ones
- missing / unreadable dataset:  tests/test_tasks.py::test_math_dataset_errors_name_the_fix,
                                 test_unreadable_dataset_files_name_the_fix, test_cli_bad_input_ends_with_one_line[dataset]
- malformed rows (skip + count): tests/test_tasks.py::test_math_dataset_skips_and_counts_malformed_rows
                                 (`tasks.data_metrics(task)` → `data/skipped_rows`, `data/skipped/<reason>`)
- weight push names / shapes:    tests/test_engines_vllm.py::test_bad_update_is_rejected_and_leaves_engine_unchanged
                                 (rejected before the engine is touched: its logprobs are unchanged afterwards)
- NaN / inf engine logprobs:     test_nonfinite_logprobs_are_masked_counted_and_stop_the_run (real vLLM, slow),
                                 test_pack_rollouts_masks_nonfinite_logprobs
- tokenizer vs model vocabulary: test_tokenizer_larger_than_model_vocab_is_rejected,
                                 test_cli_bad_input_ends_with_one_line[vocab]
- a sequence over the micro-batch token budget: test_cli_bad_input_ends_with_one_line[budget],
                                 tests/test_micro_batches.py::test_sequence_over_the_token_budget_is_a_one_line_error
- a memory knob this machine cannot run, a bad remat name, an out-of-range algorithm / correction setting
  (issue 15: every one a `portable_rl.errors.UserError`): test_cli_bad_input_ends_with_one_line[attention,
                                 remat, algorithm, correction, task_setting], test_every_user_facing_error_is_a_user_error
- the evaluate CLI, the same way: test_evaluate_cli_bad_input_ends_with_one_line[task_setting, reward, checkpoint]
- corrupt / incomplete checkpoint on resume:
    no COMMITTED marker:         tests/test_checkpoint.py::test_partially_written_step_is_never_restored
    committed but damaged:       test_damaged_committed_checkpoint_names_directory_and_fix,
                                 test_cli_bad_input_ends_with_one_line[checkpoint]
    directory unusable:          test_unusable_checkpoint_directory
"""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from portable_rl.engines.base import EngineAdapter
from portable_rl.rl.batching import pack_rollouts
from portable_rl.tasks import DatasetError, read_dataset

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory):
    """A tiny model whose tokenizer outgrew it, and a run directory whose committed checkpoint is truncated."""
    import jax.numpy as jnp
    from portable_rl.convert.hf import load_hf_model
    from portable_rl.learner_jax.checkpoint import Checkpointer
    from portable_rl.convert.tiny_checkpoint import char_tokenizer, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("bad_cli")
    model_dir = Path(make_tiny_checkpoint(root / "model"))          # vocab_size 128
    grown = root / "grown_tokenizer"
    shutil.copytree(model_dir, grown)
    tok = char_tokenizer()
    tok.add_tokens([f"<extra_{i}>" for i in range(40)], special_tokens=True)  # ids up to 138 > 127
    tok.save_pretrained(grown)
    model, _ = load_hf_model(model_dir, compute_dtype=jnp.float32)
    run = root / "run"
    with Checkpointer(run / "checkpoints") as ckpt:
        ckpt.save(4, model)
    _truncate_largest(run / "checkpoints" / "4" / "model")
    return {"model": model_dir, "grown": grown, "run": run, "root": root}


def _truncate_largest(directory: Path) -> Path:
    largest = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(10)
    return largest


CLI_CASES = {
    # name: (extra flags, text the one line must contain)
    "engine": (["--gin.vllm/engines.create_engine.name='nope'"], "unknown engine 'nope'; known engines:"),
    "task": (["--gin.TASK=@tasks.NoSuchTask()"], "@tasks.ArithmeticTask, @tasks.MathDatasetTask"),
    "reward": (["--gin.tasks.ArithmeticTask.reward='exact'"], "set the task's reward to one of exact_match"),
    "dataset": (["--gin_file=gin/data/dapo_math.gin", "--gin.DATA_PATH={root}/missing.jsonl",
                 "--gin.EVAL_DATA_PATH={root}/missing.jsonl"], "missing.jsonl does not exist; set the data path"),
    "vocab": (["--gin.MODEL_PATH={grown}"], "token ids up to 138 (139 tokens) but the model's vocab_size is 128; "
                                            "point MODEL_PATH at a checkpoint"),
    "checkpoint": (["--gin.RUN_DIR={run}"], "{run}/checkpoints/4 cannot be restored"),
    # (no dynamic sampling: the random model's groups all score 0 and would all be dropped before the learner)
    "budget": (["--gin.learner_jax.MemoryConfig.max_tokens_per_micro_batch=4", "--gin.rl.DataConfig.dynamic_sampling=False"],
               "does not fit learner_jax.MemoryConfig.max_tokens_per_micro_batch=4 (sequences are never split); raise it to at least"),
    # the learner's memory knobs (learner_jax.memory.MemoryConfig, learner_jax.attention)
    "attention": (["--gin.learner_jax.MemoryConfig.attention_impl='cudnn'"], "attention_impl='cudnn' needs a GPU (backend here: cpu); "
                                                          "use 'blockwise' (or 'auto')"),
    "remat": (["--gin.learner_jax.MemoryConfig.remat='dots'"], "remat='dots'; use one of ('none', 'full', 'dots_saveable'"),
    "algorithm": (["--gin.rl.GenerationConfig.n_samples=1"], "n_samples=1: group advantages need at least 2 samples"),
    "correction": (["--gin.tis.RolloutCorrectionConfig.clip=-1.0"], "clip must be > 0 (or None for untruncated IS)"),
    # bypass keeps the default run's token TIS: the weights would count the PPO ratio's IS twice
    "bypass": (["--gin.rl.LossConfig.policy_loss_mode='bypass'"],
               "set tis.RolloutCorrectionConfig.mode = 'none' with no masks, or policy_loss_mode = 'decoupled'"),
    "task_setting": (["--gin.tasks.ArithmeticTask.num_digits=0"], "num_digits=0 must be >= 1"),
}


# These fail after the model is loaded (~30 s each on 2 busy cores); the others fail while gin builds the task.
_AFTER_MODEL_LOAD = ("attention", "budget", "bypass", "checkpoint", "engine", "vocab")
_AFTER_ENGINE_START = ("budget",)   # fails on the first step's rollouts


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in _AFTER_MODEL_LOAD else c
                                  for c in sorted(CLI_CASES)])
def test_cli_bad_input_ends_with_one_line(case, cli_inputs, tmp_path):
    """The real train CLI: exit status 1, stderr is a single `error:` / `gin config error:` line, no traceback."""
    flags, expected = CLI_CASES[case]
    fill = {k: str(v) for k, v in cli_inputs.items()}
    args = ["--gin_file=gin/dapo_fp8.gin", f"--gin.RUN_DIR={tmp_path / 'run'}", f"--gin.MODEL_PATH={cli_inputs['model']}",
            "--gin.TRAIN_STEPS=1"] + [f.format(**fill) for f in flags]
    env = {k: v for k, v in os.environ.items() if k != "PORTABLE_RL_TRACEBACK"}
    proc = subprocess.run([sys.executable, "-m", "portable_rl.train", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    if case in _AFTER_ENGINE_START:  # the engine's own start-up log lines come first; the error is the last line
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith(("error: ", "gin config error: ")), lines
    assert expected.format(**fill) in lines[0]
    if case == "checkpoint":  # the damaged step is left as it was for the user to inspect; nothing was written
        assert (cli_inputs["run"] / "checkpoints" / "4" / "COMMITTED").exists()
        assert not (cli_inputs["run"] / "metrics.jsonl").exists()


EVALUATE_CASES = {
    "task_setting": (["--gin.tasks.ArithmeticTask.num_digits=0"], "num_digits=0 must be >= 1"),
    "reward": (["--gin.tasks.ArithmeticTask.reward='exact'"], "set the task's reward to one of exact_match"),
    "checkpoint": (["--gin.CHECKPOINT={root}/nowhere"], "nowhere does not exist; set CHECKPOINT"),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "reward" else c
                                  for c in sorted(EVALUATE_CASES)])   # reward: the train case covers the path
def test_evaluate_cli_bad_input_ends_with_one_line(case, cli_inputs):
    """The evaluate entry point prints a UserError (or a missing file) as one `error:` line, exit status 1."""
    flags, expected = EVALUATE_CASES[case]
    fill = {k: str(v) for k, v in cli_inputs.items()}
    args = ["--gin_file=gin/eval/arithmetic.gin", f"--gin.CHECKPOINT={cli_inputs['model']}"]
    env = {k: v for k, v in os.environ.items() if k != "PORTABLE_RL_TRACEBACK"}
    proc = subprocess.run([sys.executable, "-m", "portable_rl.evaluate", *args, *[f.format(**fill) for f in flags]],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected.format(**fill) in lines[0], lines


def test_unknown_parameter_names_the_close_match_or_the_valid_ones():
    from portable_rl import gin_utils
    from portable_rl.train import register_gin

    register_gin()
    gin_utils.register_library()
    import gin

    def message(binding):
        gin.clear_config()
        try:
            gin_utils.parse_gin(["gin/dapo_fp8.gin"], [binding])
        except Exception as e:
            with pytest.raises(SystemExit) as exit_info:
                gin_utils.exit_gin_error(e)
            return str(exit_info.value)
        finally:
            gin.clear_config()
        raise AssertionError(f"{binding} parsed")

    assert "(did you mean 'n_samples'?)" in message("rl.GenerationConfig.n_sample = 4")
    assert "(did you mean 'eval_size'?)" in message("rl.RunConfig.eval_sise = 4")
    assert "(it moved: set rl.GenerationConfig.n_samples)" in message("rl.DapoConfig.n_samples = 4")
    unrelated = message("train.zzz = 1")
    assert "parameters of train: run_config, engine_factory, task, dapo" in unrelated and "\n" not in unrelated


def test_every_user_facing_error_is_a_user_error():
    """One base class (portable_rl.errors.UserError) instead of a list of class names; builtin bases kept."""
    from portable_rl.convert.gguf import GgufNotFoundError
    from portable_rl.engines.ray_fleet import FleetStartTimeoutError
    from portable_rl.engines.registry import UnknownEngineError
    from portable_rl.engines.vllm_adapter import WeightUpdateError
    from portable_rl.errors import USER_ERRORS, ConfigError, UnknownNameError, UserError
    from portable_rl.learner_jax.checkpoint import CheckpointError
    from portable_rl.learner_jax.memory import MemoryConfig
    from portable_rl.rl.batching import MicroBatchBudgetError
    from portable_rl.rl.codec import VocabularyMismatchError
    from portable_rl.rl.rollout import NonFiniteLogprobsError
    from portable_rl.tasks import UnknownRewardError

    for cls, builtin in [(UnknownEngineError, KeyError), (UnknownRewardError, KeyError), (DatasetError, ValueError),
                         (WeightUpdateError, ValueError), (FleetStartTimeoutError, TimeoutError),
                         (VocabularyMismatchError, ValueError), (NonFiniteLogprobsError, RuntimeError),
                         (MicroBatchBudgetError, ValueError), (CheckpointError, RuntimeError),
                         (ConfigError, ValueError), (GgufNotFoundError, FileNotFoundError)]:
        assert issubclass(cls, builtin) and isinstance(cls("x"), USER_ERRORS), cls
    assert issubclass(UnknownEngineError, UnknownNameError) and issubclass(UnknownRewardError, UnknownNameError)
    assert str(UnknownEngineError("unknown engine 'x'")) == "unknown engine 'x'"    # no KeyError quotes
    assert not isinstance(ValueError("a bug"), USER_ERRORS)                         # a plain error keeps its traceback
    for kwargs in (dict(remat="dots"), dict(attention_impl="flash"), dict(max_tokens_per_micro_batch=0)):
        with pytest.raises(UserError):
            MemoryConfig(**kwargs)


# ------------------------------------------------------------------------------------------- data
def test_unreadable_dataset_files_name_the_fix(tmp_path):
    with pytest.raises(DatasetError, match="is a directory; point the data path at a .jsonl or .parquet file"):
        read_dataset(tmp_path)
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unsupported dataset file .*use .jsonl or .parquet"):
        read_dataset(tmp_path / "d.csv")
    (tmp_path / "d.parquet").write_bytes(b"PAR1" + bytes(64))  # a truncated parquet file
    with pytest.raises(DatasetError, match="cannot read dataset .*d.parquet.*re-export"):
        read_dataset(tmp_path / "d.parquet")
    good = json.dumps({"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}).encode()
    (tmp_path / "d.jsonl").write_bytes(good + b"\n\xff\xfe not utf-8\n" + good + b"\n")
    examples, skipped = read_dataset(tmp_path / "d.jsonl")
    assert len(examples) == 2 and skipped == {"invalid_json": 1}


# ------------------------------------------------------------------------------------------- vocab
def test_tokenizer_larger_than_model_vocab_is_rejected(cli_inputs):
    from portable_rl.rl.codec import TextCodec, VocabularyMismatchError

    codec = TextCodec(cli_inputs["model"])      # 99 tokenizer ids, vocab_size 128: padded vocab is fine
    assert max(codec.tokenizer.get_vocab().values()) < 128
    with pytest.raises(VocabularyMismatchError, match="token ids up to 138 .* vocab_size is 128"):
        TextCodec(cli_inputs["grown"])
    with pytest.raises(VocabularyMismatchError, match="vocab_size is 64"):
        TextCodec(cli_inputs["model"], model_vocab_size=64)  # an explicit model vocabulary wins


# ------------------------------------------------------------------------------------------- checkpoints
def _tiny_learner(seed=0):
    import jax.numpy as jnp
    from flax import nnx
    from portable_rl.learner_jax.config import ModelConfig
    from portable_rl.learner_jax.model import Transformer
    from portable_rl.learner_jax.optim import make_optimizer

    config = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = Transformer(config, compute_dtype=jnp.float32, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, make_optimizer(learning_rate=1e-2), wrt=nnx.Param)


def _params(model):
    import jax
    from flax import nnx
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


DAMAGE = {
    "truncated data file": lambda step: _truncate_largest(step / "model"),
    "missing metadata": lambda step: (step / "optimizer" / "_METADATA").unlink(),
    "missing item": lambda step: shutil.rmtree(step / "meta"),
    "emptied files": lambda step: [p.write_bytes(b"") for p in step.rglob("*") if p.is_file() and p.name != "COMMITTED"],
}


def test_damaged_committed_checkpoint_names_directory_and_fix(tmp_path):
    from portable_rl.learner_jax.checkpoint import CheckpointError, Checkpointer

    model, optimizer = _tiny_learner(0)
    src = tmp_path / "src"
    with Checkpointer(src) as ckpt:
        ckpt.save(1, model, optimizer)
        ckpt.save(2, model, optimizer)
    for name, damage in DAMAGE.items():
        d = tmp_path / name.replace(" ", "_")
        shutil.copytree(src, d)
        damage(d / "2")
        other, other_opt = _tiny_learner(1)
        before = _params(other)
        with Checkpointer(d) as ckpt:
            assert ckpt.latest_step() == 2   # committed: not moved aside, not skipped silently
            with pytest.raises(CheckpointError) as info:
                ckpt.restore(other, other_opt)
        msg = str(info.value)
        assert f"checkpoint {d / '2'} cannot be restored" in msg, (name, msg)
        assert f"move it aside (mv {d / '2'} {d}/corrupt-2) to resume from step 1" in msg and "\n" not in msg
        assert all(np.array_equal(a, b) for a, b in zip(before, _params(other))), name  # model untouched
        os.rename(d / "2", d / "corrupt-2")   # the fix the message names
        with Checkpointer(d) as ckpt:
            assert ckpt.restore(other, other_opt).step == 1
    # A checkpoint of a different model (same run directory, other MODEL_PATH) names the same fix.
    from flax import nnx
    from portable_rl.learner_jax.model import Transformer
    wider = Transformer(dataclasses.replace(model.config, hidden_size=64), rngs=nnx.Rngs(0))
    with Checkpointer(src) as ckpt, pytest.raises(CheckpointError, match=r"not compatible with the stored "
                                                                        r"shape.*different model"):
        ckpt.restore(wider)


def test_unusable_checkpoint_directory(tmp_path):
    from portable_rl.learner_jax.checkpoint import CheckpointError, Checkpointer

    (tmp_path / "checkpoints").write_text("a file where the directory should be")
    with pytest.raises(CheckpointError, match="checkpoint directory .*checkpoints is a file; move it away or "
                                              "choose another run directory"):
        Checkpointer(tmp_path / "checkpoints")
    (tmp_path / "parent").write_text("")
    with pytest.raises(CheckpointError, match=r"cannot use checkpoint directory .*parent/checkpoints \(.*\); fix"):
        Checkpointer(tmp_path / "parent" / "checkpoints")


# ------------------------------------------------------------------------------------------- NaN / inf logprobs
def test_pack_rollouts_masks_nonfinite_logprobs():
    b = pack_rollouts([[1, 5], [1]], [[8, 9, 2], [3, 4]], [[-0.1, math.nan, -0.3], [-math.inf, math.inf]],
                      [1.5, -2.0], min_len=4)
    np.testing.assert_array_equal(b["response_mask"][0], [0, 0, 1, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(b["response_mask"][1], [0, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b["rollout_logprobs"][0], np.float32([0, 0, -0.1, 0, -0.3, 0, 0, 0]))
    np.testing.assert_array_equal(b["advantages"][0], np.float32([0, 0, 1.5, 0, 1.5, 0, 0, 0]))
    assert all(np.isfinite(v).all() for v in b.values())
    np.testing.assert_array_equal(b["attention_mask"][1], [1, 1, 1, 0, 0, 0, 0, 0])  # the tokens stay as context


class NonFiniteEngine(EngineAdapter):
    """A real engine's rollouts with NaN / ±inf written at chosen (rollout, token) positions (the injection is
    the point: a real vLLM cannot be made to return them on purpose)."""

    def __init__(self, inner: EngineAdapter, bad):
        self.inner, self.bad, self.clean = inner, bad, None

    def generate(self, prompt_token_ids, sampling):
        self.clean = self.inner.generate(prompt_token_ids, sampling)
        return [dataclasses.replace(r, response_logprobs=[self.bad(i, t) if self.bad(i, t) is not None else lp
                                                          for t, lp in enumerate(r.response_logprobs)])
                for i, r in enumerate(self.clean)]

    def update_weights(self, named_tensors):
        self.inner.update_weights(named_tensors)

    def close(self):
        self.inner.close()


def _injected(i, t):
    """Rollout 2: every token NaN; elsewhere every 5th (rollout, token) position, cycling NaN / -inf / +inf."""
    if i == 2:
        return math.nan
    if (i + t) % 5 == 0:
        return (math.nan, -math.inf, math.inf)[(i + t) // 5 % 3]
    return None


@pytest.mark.slow
@pytest.mark.vllm
def test_nonfinite_logprobs_are_masked_counted_and_stop_the_run(cli_inputs):
    pytest.importorskip("vllm")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl import tis
    from portable_rl.convert.hf import load_hf_model
    from portable_rl.engines import create_engine
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.dapo import build_batch
    from portable_rl.rl.dapo import dapo_config
    from portable_rl.rl.learner import Learner
    from portable_rl.rl.rollout import NonFiniteLogprobsError, check_nonfinite_fraction, collect_groups
    from portable_rl.tasks import ArithmeticTask, get_reward

    path = str(cli_inputs["model"])
    cfg = dapo_config(prompt_batch_size=2, n_samples=4, dynamic_sampling=False, max_gen_batches=1,
                     max_response_tokens=8, mini_batch_size=2, temperature=1.0)
    codec, task = TextCodec(path), ArithmeticTask(num_eval=10)
    with create_engine("vllm", model_path=path, max_model_len=64) as real:
        engine = NonFiniteEngine(real, _injected)
        groups, stats = collect_groups(engine, codec, task, get_reward(task.reward), cfg, step=1, seed=0)
    clean = engine.clean
    bad = {(i, t) for i, r in enumerate(clean) for t in range(len(r.response_token_ids)) if _injected(i, t) is not None}
    total = sum(len(r.response_token_ids) for r in clean)
    assert stats["rollout/nonfinite_logprobs"] == len(bad) > len(clean[2].response_token_ids)
    assert stats["rollout/nonfinite_fraction"] == pytest.approx(len(bad) / total)

    batch, _ = build_batch(cfg, groups, codec.pad_id)
    assert all(np.isfinite(v).all() for v in batch.values())
    # The same batch from the clean rollouts with exactly those tokens masked by hand: what masking must equal.
    clean_groups = [dataclasses.replace(g, rollouts=clean[k * cfg.generation.n_samples:(k + 1) * cfg.generation.n_samples])
                    for k, g in enumerate(groups)]
    expected, _ = build_batch(cfg, clean_groups, codec.pad_id)
    for i, t in bad:
        p = len(clean[i].prompt_token_ids)
        assert expected["response_mask"][i, p + t] == 1 and batch["response_mask"][i, p + t] == 0
        expected["response_mask"][i, p + t] = expected["advantages"][i, p + t] = 0.0
    np.testing.assert_array_equal(batch["response_mask"], expected["response_mask"])
    np.testing.assert_array_equal(batch["advantages"], expected["advantages"])

    model, _ = load_hf_model(path, compute_dtype=jnp.float32)
    learner = Learner(model, nnx.Optimizer(model, make_optimizer(learning_rate=1e-3), wrt=nnx.Param), cfg,
                      tis.RolloutCorrectionConfig(mode="token", clip=2.0))
    prepared, reference = learner.prepare(batch), learner.prepare(expected)
    got, want = prepared.metrics, reference.metrics
    assert got.keys() == want.keys() and all(np.isfinite(v) for v in got.values())
    for k in got:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-7), k
    assert np.isfinite(prepared.tis_weights).all() and np.isfinite(prepared.old_logprobs).all()
    metrics = learner.update(prepared)
    assert metrics and all(np.isfinite(v) for v in metrics.values())
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

    check_nonfinite_fraction(stats, max_fraction=1.0)   # below the threshold: the step goes on
    with pytest.raises(NonFiniteLogprobsError, match=rf"returned {len(bad)} non-finite logprobs \(.*% of the step's "
                                                     rf"response tokens\) > max_nonfinite_fraction=0.01: check the "
                                                     rf"engine's dtype / quantization"):
        check_nonfinite_fraction(stats, max_fraction=cfg.safety.max_nonfinite_fraction)
