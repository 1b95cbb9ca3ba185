"""experiments/fp8_tis_experiment.py, the SmolLM2 setting: every arm is the recipe with only the rollout
precision and the correction changed, every seed sees the same problems, and the aggregation reads what the runs
wrote. The runs themselves (an hour each here) are in docs/experiments/quantized_rollouts.md."""

import dataclasses
import json
import math
import shutil
from pathlib import Path

import gin
import pytest

from experiments import fp8_tis_experiment


@pytest.fixture
def exp():
    gin.clear_config()
    yield fp8_tis_experiment
    gin.clear_config()


def _configured(exp, arm, seed):
    """The arm's training command parsed as portable_rl.train's CLI would: (engine kwargs, correction, seeds)."""
    from portable_rl import gin_utils
    from portable_rl.train import register_gin

    gin.clear_config()
    register_gin()
    cmd = exp.train_command(exp.SETTINGS["smollm2"], arm, seed, 20, Path("/tmp/run"), Path("/tmp/start"))
    gin_utils.parse_gin([c.split("=", 1)[1] for c in cmd if c.startswith("--gin_file=")],
                        [c.split("=", 1)[1] for c in cmd if c.startswith("--gin_bindings=")])
    scope = gin.query_parameter("ENGINE/macro.value").scoped_selector.split("/")[0]  # @vllm/... or @fake_quant/...
    kwargs = {k: gin_utils.query_value(f"{scope}/engines.create_engine.{k}")
              for k in ("engine_init_kwargs", "engine_kwargs", "scheme") if _bound(f"{scope}/engines.create_engine.{k}")}
    correction = gin_utils.CONFIG_OBJECTS["correction"]()
    return scope, kwargs, correction, {k: gin_utils.query_value(k) for k in
                                        ("rl.RunConfig.seed", "tasks.WordProblemsTask.seed", "rl.RunConfig.train_steps",
                                         "rl.RunConfig.eval_every", "rl.RunConfig.model_path")}


def _bound(name):
    try:
        gin.query_parameter(name)
        return True
    except ValueError:
        return False


def test_smollm2_arms_change_only_precision_and_correction(exp):
    got = {arm: _configured(exp, arm, seed=2) for arm in exp.SETTINGS["smollm2"].arms}
    for arm, (scope, kwargs, correction, seeds) in got.items():
        # same problems and held-out set for every arm and seed; a seed is only rl.RunConfig.seed
        assert seeds == {"rl.RunConfig.seed": 2, "tasks.WordProblemsTask.seed": 0, "rl.RunConfig.train_steps": 20,
                         "rl.RunConfig.eval_every": 5, "rl.RunConfig.model_path": "/tmp/start"}, arm
    assert got["bf16"][1]["engine_init_kwargs"]["quantization"] is None
    assert got["bf16"][1]["engine_init_kwargs"]["dtype"] == "float32"  # the same reference on every CPU
    for arm in ("fp8", "fp8_token_tis", "fp8_seq_mask"):
        assert got[arm][0] == "vllm" and got[arm][1]["engine_init_kwargs"]["quantization"] == "fp8_per_channel"
    for arm in ("bf16", "fp8", "fp8_token_tis", "fp8_seq_mask", "mxfp4", "mxfp4_token_tis"):  # vLLM-CPU needs it off
        init = got[arm][1].get("engine_init_kwargs") or got[arm][1]["engine_kwargs"]["engine_init_kwargs"]
        assert init["enable_chunked_prefill"] is False, arm
    for arm in ("mxfp4", "mxfp4_token_tis"):  # MXFP4-rounded weights on the unquantized arm's fp32 engine
        assert got[arm][0] == "fake_quant" and got[arm][1]["scheme"] == "mxfp4"
        init = got[arm][1]["engine_kwargs"]["engine_init_kwargs"]
        assert init["quantization"] is None and init["dtype"] == "float32", arm

    assert not got["bf16"][2].enabled and not got["fp8"][2].enabled and not got["mxfp4"][2].enabled
    for arm in ("fp8_token_tis", "mxfp4_token_tis"):
        assert (got[arm][2].mode, got[arm][2].clip) == ("token", 2.0), arm
    mask = got["fp8_seq_mask"][2]  # TRL 1.16's sequence_mask, C = 3: untruncated sequence IS, above C masked
    assert (mask.mode, mask.clip, mask.product_mask_low, mask.product_mask_high) == ("sequence", None, None, 3.0)


def test_matched_arms_are_their_token_tis_twins_with_the_engine_precision_learner(exp):
    from portable_rl import gin_utils

    for matched, twin in (("mxfp4_matched", "mxfp4_token_tis"), ("int8_matched", "int8_token_tis")):
        want = _configured(exp, twin, seed=1)
        want_precision = gin_utils.CONFIG_OBJECTS["precision"]()
        got = _configured(exp, matched, seed=1)
        precision = gin_utils.CONFIG_OBJECTS["precision"]()
        assert got == want, matched                      # engine, correction and seeds: the twin's
        assert want_precision.learner_precision == "master"
        assert precision == dataclasses.replace(want_precision, learner_precision="engine"), matched


def test_smollm2_runs_are_rescored_on_the_unquantized_arms_fp32_engine(exp, tmp_path):
    """Every SmolLM2 run's final weights are re-scored by one server, the bf16 arm's fp32 engine (its score does
    not depend on the CPU), right after the run; the toy keeps its bf16 engine."""
    from portable_rl import gin_utils
    from portable_rl.evaluate import evaluate

    setting = exp.SETTINGS["smollm2"]
    assert setting.reference_after_each_run and not exp.SETTINGS["toy"].reference_after_each_run
    run = tmp_path / "fp8" / "seed0"
    cmd = exp.reference_eval_command(setting, run, 20)
    gin.clear_config()
    gin_utils.register_configurable(evaluate, name="evaluate")
    gin_utils.parse_gin([c.split("=", 1)[1] for c in cmd if c.startswith("--gin_file=")],
                        [c.split("=", 1)[1] for c in cmd if c.startswith("--gin_bindings=")])
    scope = gin.query_parameter("ENGINE/macro.value").scoped_selector.split("/")[0]
    assert gin_utils.query_value(f"{scope}/engines.create_engine.engine_init_kwargs") == {
        "quantization": None, "enable_chunked_prefill": False, "dtype": "float32"}
    assert gin_utils.query_value("evaluate.step") == 20
    # the run's step-20 checkpoint is gone (a run keeps 2): its snapshot is scored, into the run's report
    assert gin_utils.query_value("evaluate.checkpoint") == str(exp.snapshot_dir(run, 20))
    assert gin_utils.query_value("evaluate.report_path") == str(exp.bf16_report_path(run, 20))
    train_engine = _configured(exp, "bf16", 0)[1]["engine_init_kwargs"]
    assert {k: train_engine[k] for k in ("quantization", "dtype")} == {"quantization": None, "dtype": "float32"}
    toy = exp.reference_eval_command(exp.SETTINGS["toy"], run, 20)
    assert "--gin_bindings=QUANTIZATION = None" in toy and not any("ENGINE_KWARGS" in c for c in toy)


def _write_run(path, heldout, reward=0.5, kl=0.04):
    path.mkdir(parents=True)
    rows = [{"step": s, "reward/mean": reward, "tis/kl": kl, "tis/k3_kl": kl, "response_length/mean": 20.0,
             "time/step": 60.0, **({"accuracy/heldout": heldout[s]} if s in heldout else {})} for s in range(1, 21)]
    rows.insert(0, {"step": 0, "accuracy/heldout": heldout[0]})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.gin").write_text("TRAIN_STEPS = 20\n")


def test_aggregation_finished_runs_only_and_results_copies(exp, tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results"
    heldout = {0: 0.10, 5: 0.2, 10: 0.3, 15: 0.25, 20: 0.35}
    _write_run(out / "fp8" / "seed0", heldout)
    _write_run(out / "fp8" / "seed1", {0: 0.10, 5: 0.1, 10: 0.2, 15: 0.2, 20: 0.15}, kl=0.06)
    _write_run(out / "fp8" / "seed2", {0: 0.10, 5: 0.2})          # unfinished: left out
    report = {"accuracy": 0.3, "mean_length": 41.5, "num_problems": 128, "samples": [{"response": "x"}] * 128}
    exp.bf16_report_path(out / "fp8" / "seed0", 20).write_text(json.dumps(report))
    runs = exp.finished_runs(out, None, ["fp8"], [0, 1, 2], 20)
    assert runs == {("fp8", 0): out / "fp8" / "seed0", ("fp8", 1): out / "fp8" / "seed1"}
    summary = exp.summarize(exp.SETTINGS["smollm2"], runs, ["fp8"], [0, 1, 2], 20)["fp8"]
    assert summary["seeds"] == [0, 1]
    seed0 = summary["per_seed"][0]
    assert seed0["final_heldout"] == 0.35 and seed0["start_heldout"] == 0.10
    assert math.isclose(seed0["heldout_gain"], 0.25)   # paired with the run's own step 0
    assert math.isclose(seed0["late_heldout"], (0.3 + 0.25 + 0.35) / 3)   # the evaluations at steps >= 10
    st = summary["stats"]
    assert math.isclose(st["final_heldout"]["mean"], 0.25) and math.isclose(st["mean_kl"]["mean"], 0.05)
    assert math.isclose(st["final_heldout"]["std"], math.sqrt(2 * 0.1 ** 2))  # ddof = 1 over the two seeds

    exp.copy_results(out / "fp8" / "seed0", results)
    # the reference engine's score and answer length are kept, its 128 records are not (they are large)
    assert json.loads(exp.bf16_report_path(results / "fp8" / "seed0", 20).read_text()) == {
        "accuracy": 0.3, "mean_length": 41.5, "num_problems": 128}
    assert (results / "fp8" / "seed0" / "metrics.jsonl").read_text() == (out / "fp8" / "seed0" / "metrics.jsonl").read_text()
    assert exp.is_finished(results / "fp8" / "seed0", 20) and not exp.is_finished(out / "fp8" / "seed2", 20)
    again = exp.summarize(exp.SETTINGS["smollm2"], exp.finished_runs(results, None, ["fp8"], [0, 1, 2], 20),
                          ["fp8"], [0, 1, 2], 20)["fp8"]
    assert again["per_seed"][0] == seed0   # the committed copies aggregate like the run directories

    # A new machine: seed 2 finished in an earlier session (only its committed copy), seed 0 both here and
    # committed (the live run wins), seed 1 here only; the aggregate takes all three.
    _write_run(results / "fp8" / "seed2", {0: 0.10, 5: 0.1, 10: 0.1, 15: 0.1, 20: 0.05})
    runs = exp.finished_runs(out, results, ["fp8"], [0, 1, 2], 20)
    assert runs == {("fp8", 0): out / "fp8" / "seed0", ("fp8", 1): out / "fp8" / "seed1",
                    ("fp8", 2): results / "fp8" / "seed2"}
    summary = exp.summarize(exp.SETTINGS["smollm2"], runs, ["fp8"], [0, 1, 2], 20)["fp8"]
    assert summary["seeds"] == [0, 1, 2] and math.isclose(summary["stats"]["final_heldout"]["mean"], 0.55 / 3)
    table = exp.runs_table(exp.SETTINGS["smollm2"], runs, ["fp8"], [0, 1, 2], 20).splitlines()
    assert len(table) == 2 + 3 and table[-1].startswith("| fp8_per_channel, no correction | 2 | ? | 10.0 % |")
    assert "| fp32-served @20 |" in table[0] and "| 5.0 % |  | 0.500 |" in table[-1]   # not re-scored
    exp.bf16_report_path(results / "fp8" / "seed2", 20).write_text(json.dumps({"accuracy": 0.0625}))
    table = exp.runs_table(exp.SETTINGS["smollm2"], runs, ["fp8"], [0, 1, 2], 20).splitlines()
    assert "| 5.0 % | 6.2 % | 0.500 |" in table[-1]


def test_the_reference_arm_is_reference_served_by_its_own_evaluation(exp, tmp_path):
    # The unquantized arm's own engine is the reference engine: a run of it whose checkpoint is gone (no
    # re-score) still has a reference-served score, its own; a quantized arm without a re-score has none.
    setting = exp.SETTINGS["smollm2"]
    _write_run(tmp_path / "bf16" / "seed0", {0: 0.14, 5: 0.04, 10: 0.04, 15: 0.04, 20: 0.03125})
    _write_run(tmp_path / "fp8" / "seed0", {0: 0.09, 5: 0.1, 10: 0.1, 15: 0.1, 20: 0.0625})
    runs = exp.finished_runs(tmp_path, None, ["bf16", "fp8"], [0], 20)
    summary = exp.summarize(setting, runs, ["bf16", "fp8"], [0], 20)
    assert summary["bf16"]["per_seed"][0]["final_heldout_bf16_served"] == 0.03125
    assert summary["bf16"]["per_seed"][0]["bf16_minus_own_serving"] == 0.0
    assert math.isnan(summary["fp8"]["per_seed"][0]["final_heldout_bf16_served"])
    bf16_row, fp8_row = exp.runs_table(setting, runs, ["bf16", "fp8"], [0], 20).splitlines()[2:]
    assert "| 3.1 % | 3.1 % |" in bf16_row and "| 6.2 % |  |" in fp8_row
    # a re-score, where one exists, is what counts (it is a separate evaluation of the checkpoint)
    exp.bf16_report_path(tmp_path / "bf16" / "seed0", 20).write_text(json.dumps({"accuracy": 0.0390625}))
    rescored = exp.summarize(setting, runs, ["bf16"], [0], 20)["bf16"]["per_seed"][0]
    assert rescored["final_heldout_bf16_served"] == 0.0390625


INTEL = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16\n"
AMD = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n"


def test_each_segment_of_a_run_records_its_cpu(exp, tmp_path):
    (tmp_path / "intel").write_text(INTEL)
    (tmp_path / "amd").write_text(AMD)
    assert exp.box_description(str(tmp_path / "intel")).startswith("Intel(R) Xeon(R) Processor, ")
    assert exp.box_description(str(tmp_path / "intel")).endswith("bf16 dot products: amx_bf16/avx512_bf16")
    assert exp.box_description(str(tmp_path / "amd")).endswith("bf16 dot products: none")

    run, results = tmp_path / "runs" / "fp8" / "seed0", tmp_path / "results"
    run.mkdir(parents=True)
    assert exp.run_boxes(run) == "?"                       # a run from before the record: unknown
    exp.record_box(run, str(tmp_path / "amd"))             # a new run
    first = (run / "boxes.txt").read_text()
    shutil.rmtree(run)
    _write_run(run, {0: 0.1, 5: 0.1, 10: 0.1})            # it got to step 20 (rows 0-20) ...
    (run / "boxes.txt").write_text(first)
    exp.record_box(run, str(tmp_path / "intel"))           # ... and resumed on another machine
    lines = (run / "boxes.txt").read_text().splitlines()
    assert len(lines) == 2 and "from step 0" in lines[0] and "AMD EPYC 7B13" in lines[0]
    assert "from step 20" in lines[1] and "Intel(R) Xeon(R)" in lines[1]
    assert exp.run_boxes(run) == "AMD, no bf16 + Intel, AMX"
    exp.copy_results(run, results)
    assert exp.run_boxes(results / "fp8" / "seed0") == "AMD, no bf16 + Intel, AMX"
    zen5 = tmp_path / "zen5"                               # an AMD box with bf16 dot products is its own kind
    zen5.write_text(AMD.replace("AMD EPYC 7B13", "AMD EPYC").replace("fma", "fma avx512f avx512_bf16"))
    exp.record_box(run, str(zen5))
    assert exp.run_boxes(run) == "AMD, no bf16 + Intel, AMX + AMD, avx512_bf16"


def test_an_arm_of_another_setting_is_one_line(exp):
    with pytest.raises(SystemExit) as e:
        exp.main(["--setting", "smollm2", "--arms", "fp8_seq_tis", "--aggregate_only"])
    assert "not an arm of --setting smollm2" in str(e.value) and "\n" not in str(e.value)


def test_finishing_a_run_re_scores_quantized_arms_only(exp, tmp_path, monkeypatch):
    # The reference arm's own evaluation is already served by the reference engine: re-scoring it would be a
    # second identical evaluation (minutes); every other arm is re-scored once, and its results copied.
    setting, rescored = exp.SETTINGS["smollm2"], []
    monkeypatch.setattr(exp, "eval_bf16",
                        lambda setting, run_dir, steps, code_dir: rescored.append(run_dir.parent.name))
    for arm in ("bf16", "fp8"):
        _write_run(tmp_path / "runs" / arm / "seed0", {0: 0.14, 5: 0.1, 10: 0.1, 15: 0.1, 20: 0.1})
        exp.finish_run(setting, tmp_path / "runs" / arm / "seed0", 20, tmp_path, tmp_path / "results")
        assert exp.is_finished(tmp_path / "results" / arm / "seed0", 20)
    assert rescored == ["fp8"]


def test_eval_bf16_flag_re_scores_quantized_arms_only(exp, tmp_path, monkeypatch):
    # --eval_bf16 (the toy's after-the-fact re-score of every finished run) skips the reference arm as finish_run
    # does: its own held-out evaluation already ran on the reference engine, and the aggregate reads it from there.
    rescored = []
    monkeypatch.setattr(exp, "eval_bf16",
                        lambda setting, run_dir, steps, code_dir: rescored.append(run_dir.parent.name))
    for arm in ("bf16", "fp8"):
        _write_run(tmp_path / "runs" / arm / "seed0", {0: 0.14, 10: 0.3, 20: 0.4})
    exp.main(["--setting", "toy", "--arms", "bf16", "fp8", "--seeds", "0", "--steps", "20", "--aggregate_only",
              "--eval_bf16", "--out", str(tmp_path / "runs"), "--img_dir", str(tmp_path / "img")])
    assert rescored == ["fp8"]


def test_a_run_of_a_few_arms_reports_the_whole_experiment(exp, tmp_path):
    # A session that runs --arms mxfp4 --seeds 0 must not rewrite the experiment's plots and table with that
    # subset: after runs, the report covers every arm and seed finished here or in the committed copies.
    setting, out, results = exp.SETTINGS["smollm2"], tmp_path / "runs", tmp_path / "results"
    full = {0: 0.1, 5: 0.1, 10: 0.1, 15: 0.1, 20: 0.1}
    for arm in ("bf16", "fp8"):
        for seed in (0, 1, 2):
            _write_run(results / arm / f"seed{seed}", full)
    _write_run(out / "mxfp4" / "seed0", full)
    _write_run(out / "mxfp4_token_tis" / "seed0", {0: 0.1, 5: 0.1})   # unfinished: not an arm of the report
    arms, seeds = exp.report_scope(setting, out, results, ["mxfp4"], [0], 20, aggregate_only=False)
    assert arms == ["bf16", "fp8", "mxfp4"] and seeds == [0, 1, 2]
    # --aggregate_only reports exactly what was asked for
    assert exp.report_scope(setting, out, results, ["mxfp4"], [0], 20, aggregate_only=True) == (["mxfp4"], [0])


def test_served_plot_shows_the_runs_with_a_reference_score(exp, tmp_path):
    out, img = tmp_path / "runs", tmp_path / "img"
    img.mkdir()
    _write_run(out / "bf16" / "seed0", {0: 0.14, 5: 0.1, 10: 0.1, 15: 0.1, 20: 0.2})
    _write_run(out / "mxfp4" / "seed0", {0: 0.02, 5: 0.03, 10: 0.04, 15: 0.05, 20: 0.06})
    runs = exp.finished_runs(out, None, ["bf16", "mxfp4"], [0], 20)
    summary = exp.summarize(exp.SETTINGS["smollm2"], runs, ["bf16", "mxfp4"], [0], 20)
    assert exp.plot_served(exp.SETTINGS["smollm2"], {"mxfp4": summary["mxfp4"]}, ["mxfp4"], 20, img) == []  # no score
    exp.bf16_report_path(out / "mxfp4" / "seed0", 20).write_text(json.dumps({"accuracy": 0.03}))
    summary = exp.summarize(exp.SETTINGS["smollm2"], runs, ["bf16", "mxfp4"], [0], 20)
    assert summary["mxfp4"]["per_seed"][0]["final_heldout_bf16_served"] == 0.03
    [path] = exp.plot_served(exp.SETTINGS["smollm2"], summary, ["bf16", "mxfp4"], 20, img, prefix="t")
    assert path == img / "t_served.png" and path.stat().st_size > 10_000
