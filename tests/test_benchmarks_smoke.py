"""The benchmark scripts run end to end in their tiniest modes and report what docs/benchmarks.md quotes.

Each script runs as a subprocess, as a user would run it (`python -m benchmarks.X` from the repository root).
learner_step and the others compile JAX steps or start vLLM engines in fresh interpreters (tens of seconds to
minutes on a small CPU), hence `slow`; the run-dir breakdown is instant. The GPU check's dry run and the
colocation check are tests/test_benchmarks_gpu_check.py (a file of their own, so the two test workers share
the benchmarks' time).

The scripts that compile JAX programs (learner_step, learner_memory, learner_throughput, routing_replay) run here
without LLVM's optimizations (`UNOPTIMIZED`, as conftest.py does in process and the planner's compile process
does): tiny programs compiled once and run once or twice, where compiling dominates; the arithmetic and buffer
assignment (every byte learner_memory reports) are the same, only the machine code is less optimized. No speed is
asserted here.
"""

import importlib
import json
import os
import pkgutil
import sys
from pathlib import Path

import pytest
from processes import ROOT
from processes import run_from_root as run

import benchmarks
import experiments

UNOPTIMIZED = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


@pytest.mark.parametrize("package", [benchmarks, experiments], ids=lambda p: p.__name__)
def test_every_script_imports_as_a_module_of_its_package(package):
    """`python -m benchmarks.X` / `python -m experiments.X`: each script imports through its package (shared
    helpers as `benchmarks.bench_common`), with no sys.path edits, and has a main()."""
    import re

    names = [m.name for m in pkgutil.iter_modules(package.__path__)]
    assert len(names) >= 4
    siblings = re.compile(r"^\s*(from|import) (" + "|".join(names) + r")\b", re.M)  # also inside functions
    for name in names:
        module = importlib.import_module(f"{package.__name__}.{name}")
        source = Path(module.__file__).read_text()
        assert "sys.path" not in source and not siblings.search(source), module.__file__
        assert name == "bench_common" or callable(getattr(module, "main", None)), module.__name__


def test_docs_name_scripts_that_are_there():
    """Every `python -m benchmarks.X` / `experiments.X` and `benchmarks/X.py` / `experiments/X.py` that the docs,
    the recipes and the code name is a file (the drivers moved from benchmarks/ to experiments/)."""
    import re

    sources = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md"),
               *(ROOT / "gin").rglob("*.gin"), *(ROOT / "portable_rl").rglob("*.py"), *(ROOT / "benchmarks").glob("*.[ps][yh]"),
               *(ROOT / "experiments").glob("*.py"), *(ROOT / "tests").glob("*.py")]
    named = set()
    for src in sources:
        text = src.read_text()
        named |= {f"{pkg}/{name}.py" for pkg, name in re.findall(r"\b(benchmarks|experiments)\.([a-z_0-9]+)\b", text)
                  if name not in ("md", "py", "sh", "X")}
        named |= set(re.findall(r"\b(?:benchmarks|experiments)/[a-z_0-9]+\.(?:py|sh)\b", text))
    assert len(named) > 10
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, missing


@pytest.mark.slow
def test_learner_step_tiny_same_work_and_ratio(tmp_path):
    out = run([sys.executable, "-m", "benchmarks.learner_step", "--sizes", "tiny", "--dtypes", "fp32",
               "--reps", "1", "--rows", "2", "--seq", "16", "--json", "--workdir", str(tmp_path)],
              timeout=600, **UNOPTIMIZED)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["torch_threads"] == os.cpu_count()
    (r,) = result["runs"]
    assert (r["size"], r["dtype"], r["rows"], r["seq"]) == ("tiny", "fp32", 2, 16)
    first = r["first_step"]
    assert first["same_work"]
    # the two frameworks really computed the same first step (not just both finite)
    for key in ("loss", "grad_norm"):
        assert abs(first["jax"][key] - first["torch"][key]) <= first["rtol"] * abs(first["torch"][key])
    assert first["jax"]["grad_norm"] > 0
    for key in ("jax_step_s", "torch_step_s", "jax_tokens_per_s", "torch_tokens_per_s", "ratio"):
        assert r[key] > 0
    assert r["ratio"] == pytest.approx(r["jax_tokens_per_s"] / r["torch_tokens_per_s"])
    assert r["params"] > 100_000  # the tiny Qwen2 preset, ~0.3M


def test_rollout_run_dir_breakdown(tmp_path):
    rows = [{"step": 0, "time/sync": 5.0}]  # the initial sync row has no time/step and must be skipped
    for step in range(1, 6):
        rows.append({"step": step, "time/generate": 0.5, "time/logprob": 0.1, "time/train": 0.2 + 0.01 * step,
                     "time/sync": 0.02 * step, "time/step": 1.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    b = json.loads(run([sys.executable, "-m", "benchmarks.rollout", "--run-dir", str(tmp_path), "--json"], 120))
    assert b["steps"] == 5
    assert b["medians_s"]["time/sync"] == pytest.approx(0.06)
    assert b["medians_s"]["time/train"] == pytest.approx(0.23)
    assert b["shares"]["time/generate"] == pytest.approx(0.5)
    assert b["other_share"] == pytest.approx(1 - (0.5 + 0.1 + 0.23 + 0.06))
    assert b["sync_ok"] is False  # 6 % > 5 %


@pytest.mark.slow
def test_rollout_throughput_arms_name_their_kernels(tmp_path):
    """The speed benchmark's INT8 arm runs and says which kernel served (tiny model: a smoke test, no speed)."""
    out = json.loads(run([sys.executable, "-m", "benchmarks.rollout", "--tiny", "--prompts", "2", "--max-tokens", "4",
                          "--reps", "1", "--arms", "bf16", "int8_per_channel", "--workdir", str(tmp_path), "--json"],
                         300).splitlines()[-1])
    assert out["best_unquantized"] == "bf16" and out["ratio_over_best_unquantized"]["bf16"] == 1.0
    assert out["served_by"]["bf16"].endswith("unquantized")
    assert "CPUInt8ScaledMMLinearKernel._apply_weights_" in out["served_by"]["int8_per_channel"]
    assert all(n > 0 for n in out["generated_tokens"].values())


def test_rollout_decode_summary_ratios_against_the_faster_unquantized_arm():
    """The decode mode's arithmetic on made-up calls: medians over measured repetitions (warm-up excluded),
    best unquantized = the fp32 / bf16 arm of higher median decode tokens/s, ratios of medians and per rep."""
    from benchmarks.rollout import rotated, summarize_decode

    b, t = 4, 11  # prompts, max_tokens: decode tokens/s = 4 * 10 / decode_s

    def call(rep, arm, generate_s, prefill_s):
        d = generate_s - prefill_s
        return {"rep": rep, "warmup": rep == 0, "arm": arm, "generate_s": generate_s, "prefill_s": prefill_s,
                "decode_s": d, "decode_tokens_per_s": b * (t - 1) / d, "rollout_tokens_per_s": b * t / generate_s}

    times = {"bf16": [9.0, 5.0, 4.0, 6.0], "fp32": [9.0, 3.0, 2.0, 2.5], "int8_per_channel": [9.0, 2.0, 1.5, 1.0]}
    calls = [call(rep, arm, times[arm][rep] + 1.0, 1.0) for rep in range(4) for arm in times]
    s = summarize_decode(calls, list(times))
    assert s["best_unquantized"] == "fp32"  # fp32 decodes faster here, so it is the baseline
    fp32, int8 = s["arms"]["fp32"], s["arms"]["int8_per_channel"]
    assert fp32["decode_s"] == 2.5 and fp32["decode_tokens_per_s"] == pytest.approx(40 / 2.5)  # warm-up 9.0 left out
    assert int8["decode_tokens_per_s"] == pytest.approx(40 / 1.5)
    assert int8["decode_ratio"] == pytest.approx((40 / 1.5) / (40 / 2.5))
    assert int8["rollout_ratio"] == pytest.approx((44 / 2.5) / (44 / 3.5))
    assert int8["decode_ratio_per_rep"] == pytest.approx([3.0 / 2.0, 2.0 / 1.5, 2.5 / 1.0])
    assert fp32["decode_ratio"] == 1.0 and s["arms"]["bf16"]["decode_ratio"] == pytest.approx(2.5 / 5.0)
    assert [rotated(["a", "b", "c"], rep) for rep in range(4)] == [["a", "b", "c"], ["b", "c", "a"],
                                                                    ["c", "a", "b"], ["a", "b", "c"]]


@pytest.mark.slow
def test_rollout_decode_writes_every_call(tmp_path):
    """`--decode` end to end on the tiny model (2 arms, 2 reps, 4 tokens: structure, not speed): the raw file
    holds every call of every arm and repetition at the forced length, and its summary follows from the calls."""
    import re
    import statistics

    from benchmarks.rollout import WARMUP_TOKENS

    out_file = tmp_path / "decode.json"
    stdout = run([sys.executable, "-m", "benchmarks.rollout", "--decode", "--tiny", "--prompts", "2", "--max-tokens", "4",
                  "--reps", "2", "--prompt-len", "8", "12", "--arms", "bf16", "int8_per_channel",
                  "--workdir", str(tmp_path), "--out", str(out_file), "--json"], 300)
    r = json.loads(out_file.read_text())
    assert r == json.loads(stdout.splitlines()[-1])
    assert (r["mode"], r["prompts"], r["max_tokens"], r["reps"]) == ("decode", 2, 4, 2)
    assert "--decode" in r["command"] and re.fullmatch(r"[0-9a-f]{40}", r["git_commit"])
    assert r["cpu_model"] and all(re.fullmatch(r"avx512[a-z_0-9]*|avx_vnni|amx[a-z_0-9]*", f) for f in r["cpu_flags"])
    assert 8 <= r["prompt_tokens"]["min"] <= r["prompt_tokens"]["max"] <= 12
    # the INT8 arm runs the glue dtype the adapter picks on this box, with an int8 kernel
    assert r["served_by"]["int8_per_channel"].startswith(r["adapter_int8_dtype"]["dtype"] + ", CPUInt8ScaledMM")
    calls = r["calls"]
    assert len(calls) == 2 * 3 and [c["warmup"] for c in calls] == [True, True] + [False] * 4
    assert [c["arm"] for c in calls] == ["bf16", "int8_per_channel", "int8_per_channel", "bf16", "bf16",
                                         "int8_per_channel"]  # rotated one arm per repetition
    for c in calls:
        t = min(WARMUP_TOKENS, 4) if c["warmup"] else 4
        assert c["generated_tokens"] == 2 * t and c["served_by"] == r["served_by"][c["arm"]]
        assert c["decode_s"] == pytest.approx(c["generate_s"] - c["prefill_s"])
        assert c["decode_tokens_per_s"] == pytest.approx(2 * (t - 1) / c["decode_s"])
    assert r["best_unquantized"] == "bf16"
    for arm, s in r["arms"].items():
        measured = [c for c in calls if c["arm"] == arm and not c["warmup"]]
        assert s["decode_tokens_per_s"] == pytest.approx(statistics.median(c["decode_tokens_per_s"] for c in measured))
        assert s["decode_ratio"] == pytest.approx(s["decode_tokens_per_s"] / r["arms"]["bf16"]["decode_tokens_per_s"])
    assert r["arms"]["bf16"]["decode_ratio"] == 1.0


@pytest.mark.slow
def test_learner_memory_tiny_reports_old_and_new_peak():
    out = run([sys.executable, "-m", "benchmarks.learner_memory", "--model", "tiny", "--tokens_per_device", "256",
               "--fsdp", "2", "--path", "both", "--chunk_tokens", "64", "--micro_tokens", "128", "--json"],
              timeout=600, **UNOPTIMIZED)
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["path"] for r in rows] == ["old", "new"]
    # tiny: V=256, D=64, 2 layers of q (64x64), k, v (64x32), o (64x64), gate/up/down (64x128), norms
    matrices = 2 * 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)   # split in 2 along D
    vectors = 64 + 2 * (2 * 64 + 2 * 16)                                       # replicated gains
    for r in rows:
        assert (r["model"], r["tokens_per_device"], r["fsdp"]) == ("tiny", 256, 2)
        assert r["params_bytes"] == 2 * (matrices // 2 + vectors)               # bf16, 1/fsdp of each matrix
        # f32 master + two f32 AdamW moments = 6x the bf16 params, plus a few scalar counters
        assert 0 <= r["optimizer_bytes"] - 6 * r["params_bytes"] < 64
        for f in r["functions"]:
            assert f["compile_seconds"] > 0 and f["temp_bytes"] > 0
        assert r["peak_bytes_per_device"] == max(f["live_bytes"] for f in r["functions"])
        assert r["peak_bytes_per_device"] > r["params_bytes"] + r["optimizer_bytes"] + r["temp_bytes"] - 1
        assert r["compile_seconds"] == pytest.approx(sum(f["compile_seconds"] for f in r["functions"]))
    old, new = rows
    assert old["knobs"]["attention_impl"] == "dense" and old["knobs"]["remat"] == "none"
    assert [f["name"] for f in old["functions"]] == ["train_step"]
    # new: 256 tokens in micro-batches of 128 -> gradient accumulation (grad step + apply step), f32 accumulator
    assert new["micro_batches"] == 2 and [f["name"] for f in new["functions"]] == ["grad_step", "apply_step"]
    assert new["grad_accumulator_bytes"] == 2 * new["params_bytes"]
    assert new["knobs"]["logprob_chunk_tokens"] == 64 and new["knobs"]["max_tokens_per_micro_batch"] == 128


@pytest.mark.slow
def test_learner_throughput_tiny_same_update_on_all_sides(tmp_path):
    out = run([sys.executable, "-m", "benchmarks.learner_throughput", "--layers", "1", "--hidden", "32",
               "--intermediate", "64", "--heads", "2", "--vocab", "128", "--sequences", "4",
               "--prompt_tokens", "8", "--median_response", "24", "--max_response", "64", "--dtypes", "fp32",
               "--reps", "1", "--chunk_tokens", "32", "--json", "--workdir", str(tmp_path)], timeout=900, **UNOPTIMIZED)
    r = json.loads(out.strip().splitlines()[-1])
    lengths = r["response_lengths"]
    assert len(lengths) == 4 and all(16 <= n <= 64 for n in lengths)
    assert r["real_tokens"] == sum(8 + n for n in lengths)
    assert r["same_work"]
    sides = {run_["side"]: run_ for run_ in r["runs"]}
    assert set(sides) == {"new", "old", "torch"}
    norms = [s["first_update"]["grad_norm"] for s in sides.values()]
    assert min(norms) > 0 and max(norms) - min(norms) <= 1e-3 * max(norms)   # one gradient, three ways
    for s in sides.values():
        assert s["tokens_per_s"] == pytest.approx(r["real_tokens"] / s["update_s"])
    # the old layout pads every row to a power of two, torch to the longest: both compute padding
    assert sides["old"]["padded_tokens"] >= sides["torch"]["padded_tokens"] >= r["real_tokens"]
    new_over_torch = sides["new"]["tokens_per_s"] / sides["torch"]["tokens_per_s"]
    assert r["ratio_vs_torch"]["new"] == pytest.approx(new_over_torch)


@pytest.mark.slow
def test_routing_replay_tiny_times_every_arm_on_the_same_routed_batch(tmp_path):
    out = tmp_path / "replay_cost.json"
    run([sys.executable, "-m", "benchmarks.routing_replay", "--size", "tiny", "--experts", "4", "--groups", "2",
         "--samples", "2", "--prompt-tokens", "8", "--response-tokens", "8", "--reps", "1", "--json", str(out)],
        timeout=600, **UNOPTIMIZED)
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"own", "replay", "compare"} and all(v > 0 for v in result["seconds"].values())
    assert result["batch_shape"][0] == 4 and result["batch_shape"][-1] == 2  # 4 sequences, top-2 routing
    import statistics

    med = {arm: statistics.median(t) for arm, t in result["raw_seconds"].items()}
    assert result["replay_share"] == pytest.approx(med["replay"] / med["own"] - 1)
