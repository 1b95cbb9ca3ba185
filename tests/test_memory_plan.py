"""The memory plan (portable_rl/rl/colocation.py): the formula on a Qwen3-8B-shaped checkpoint (header only),
the environment the user set winning, one-line errors naming the knob, and the CLI stopping before anything
loads. No JAX, no device: the plan is decided before either exists."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portable_rl.errors import UserError
from portable_rl.rl.colocation import (ALLOCATOR, GB, MEM_FRACTION, PREALLOCATE, MemoryPlan, MemoryPlanError,
                                        checkpoint_bytes, kv_bytes_per_token)
from portable_rl.planning.shapes_only import write_shapes_only_checkpoint

ROOT = Path(__file__).resolve().parent.parent
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
            "tie_word_embeddings": False}
QWEN3_8B_PARAMS = 8_190_735_360  # Qwen/Qwen3-8B's published count


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory):
    return write_shapes_only_checkpoint(tmp_path_factory.mktemp("qwen3_8b"), QWEN3_8B)


def plan(path, **kw):
    base = dict(learner_peak_gb=85.9, model_path=path, max_model_len=22528, device_memory_gb=141.0,
                learner_shards=8, quantization="fp8", param_dtype="bfloat16")  # the 8B recipes' dtypes
    return MemoryPlan(**{**base, **kw})


def test_sizes_from_the_checkpoint_headers(qwen3_8b):
    params, fp8_bytes = checkpoint_bytes(qwen3_8b, quantized=True)
    assert params == QWEN3_8B_PARAMS
    embed_and_head = 2 * 151936 * 4096
    norms = 36 * (2 * 4096 + 2 * 128) + 4096
    projections = params - embed_and_head - norms
    assert fp8_bytes == projections * 1 + (embed_and_head + norms) * 2
    assert checkpoint_bytes(qwen3_8b, quantized=False)[1] == 2 * params
    assert kv_bytes_per_token(qwen3_8b) == 2 * 36 * 8 * 128 * 2  # 147 456 bytes: K and V, bf16


def test_time_shared_qwen3_8b_on_an_h200(qwen3_8b):
    b = plan(qwen3_8b, sleep_engine=True).decide(environ={})
    m = 141.0 * GB
    resident = QWEN3_8B_PARAMS * (2 + 4 + 8) / 8  # bf16 params + f32 master + f32 AdamW m, v over fsdp=8
    assert b.learner_resident_bytes == pytest.approx(resident)
    assert b.engine_fraction == math.floor((m - resident - 2 * GB) / m * 100) / 100
    assert b.xla_env == {PREALLOCATE: "false", ALLOCATOR: "platform"} and b.learner_fraction is None
    assert b.engine_kwargs() == {"enable_sleep_mode": True, "gpu_memory_utilization": b.engine_fraction}
    kv_budget = b.engine_fraction * m - b.weights_bytes - 3.0 * GB
    assert b.kv_tokens == int(kv_budget / (2 * 36 * 8 * 128 * 2)) > 22528
    line = b.line()
    assert "\n" not in line and line.startswith("[memory] time-shared")
    for part in ("peak 85.9", f"engine {b.engine_fraction:.2f}", f"{b.kv_tokens} tokens", "of 141.0 GB",
                 "XLA_PYTHON_CLIENT_ALLOCATOR=platform"):
        assert part in line, (part, line)


def test_resident_layout_splits_the_device(qwen3_8b):
    b = plan(qwen3_8b, sleep_engine=False, learner_peak_gb=60.0).decide(environ={})
    m = 141.0 * GB
    assert b.learner_fraction == math.ceil((60.0 * GB + 1 * GB) / m * 100) / 100  # peak + reserve / 2
    assert b.xla_env == {MEM_FRACTION: f"{b.learner_fraction:.2f}"}
    assert b.engine_fraction == math.floor((1 - b.learner_fraction - 2 * GB / m) * 100) / 100
    assert b.engine_kwargs() == {"gpu_memory_utilization": b.engine_fraction}  # no sleep mode
    assert b.line().startswith("[memory] resident: learner")


def test_the_users_environment_wins_and_is_checked(qwen3_8b):
    env = {MEM_FRACTION: "0.5", PREALLOCATE: "true"}
    b = plan(qwen3_8b, sleep_engine=False, learner_peak_gb=60.0).decide(environ=env)
    assert b.learner_fraction == 0.5 and b.xla_env == {}
    assert b.user_set == (MEM_FRACTION, PREALLOCATE) and "from your environment" in b.line()
    assert b.apply(env) == {} and env == {MEM_FRACTION: "0.5", PREALLOCATE: "true"}
    with pytest.raises(MemoryPlanError, match=r"raise XLA_PYTHON_CLIENT_MEM_FRACTION \(set in your environment\)"):
        plan(qwen3_8b, sleep_engine=False, learner_peak_gb=80.0).decide(environ=env)  # 80 GB > 0.5 x 141
    with pytest.raises(MemoryPlanError, match="SLEEP_ENGINE=True needs XLA without preallocation"):
        plan(qwen3_8b, sleep_engine=True).decide(environ={PREALLOCATE: "true"})
    with pytest.raises(MemoryPlanError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='lots' .* is not a number"):
        plan(qwen3_8b, sleep_engine=False).decide(environ={MEM_FRACTION: "lots"})
    kept = {ALLOCATOR: "cuda_async"}
    b = plan(qwen3_8b, sleep_engine=True).decide(environ=kept)
    assert b.apply(kept) == {PREALLOCATE: "false"} and kept == {ALLOCATOR: "cuda_async", PREALLOCATE: "false"}


@pytest.mark.parametrize("kw, knob", [
    (dict(sleep_engine=True, device_memory_gb=80.0), "lower the learner's peak"),              # 85.9 GB > an H100
    (dict(sleep_engine=False, device_memory_gb=100.0), "set SLEEP_ENGINE=True"),         # both resident: no room
    (dict(sleep_engine=True, learner_shards=1, learner_peak_gb=120.0, device_memory_gb=135.0, quantization=None),
     "shard the learner over more devices"),                                                  # 114.7 GB of state stays resident
    (dict(learner_shards=1), "is below the learner's own state, 114.7 GB per device"),
    (dict(engine="sglang"), "SGLang: mem_fraction_static"),
    (dict(learner_peak_gb=None), "set LEARNER_PEAK_GB"),
    (dict(model_path="/nonexistent"), "set MODEL_PATH"),
])
def test_a_plan_that_cannot_fit_is_one_line_naming_the_knob(qwen3_8b, kw, knob):
    path = kw.pop("model_path", qwen3_8b)
    with pytest.raises(MemoryPlanError) as e:
        plan(path, **kw).decide(environ={})
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)
    assert knob in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_no_gpu_means_nothing_is_set(qwen3_8b, monkeypatch):
    monkeypatch.setattr("portable_rl.rl.colocation.detect_device_memory", lambda: (None, 0, "no nvidia-smi"))
    env = {}
    b = plan(qwen3_8b, device_memory_gb=None).decide(environ=env)
    assert not b.active and b.engine_kwargs() == {} and b.apply(env) == {} and env == {}
    assert "plan not applied: no GPU" in b.line()


def test_gin_file_binds_the_plan_and_the_cli_applies_it(qwen3_8b, monkeypatch, capsys):
    import gin

    from portable_rl import gin_utils
    from portable_rl.train import register_gin

    for key in (PREALLOCATE, MEM_FRACTION, ALLOCATOR):
        monkeypatch.delenv(key, raising=False)  # restored after the test
    gin.clear_config()
    try:
        register_gin()
        gin_utils.parse_gin(["gin/dapo_fp8.gin", "gin/learner/mesh.gin", "gin/colocate.gin"],
                            [f"MODEL_PATH = '{qwen3_8b}'", "LEARNER_PEAK_GB = 85.9", "DEVICE_MEMORY_GB = 141.0",
                             "MESH_FSDP = 8", "MAX_MODEL_LEN = 22528"])
        budget = gin_utils.memory_budget()
    finally:
        gin.clear_config()
    assert budget.sleep_engine and budget.active and budget.plan.quantization == "fp8_per_channel"
    # dapo_fp8.gin trains float32 params (no separate master copy): 4 + 2 x 4 bytes per parameter
    assert budget.learner_resident_bytes == pytest.approx(QWEN3_8B_PARAMS * 12 / 8)
    assert os.environ[PREALLOCATE] == "false" and os.environ[ALLOCATOR] == "platform"
    assert capsys.readouterr().out.strip() == budget.line()


def test_default_config_binds_no_plan():
    import gin

    from portable_rl import gin_utils
    from portable_rl.train import register_gin

    gin.clear_config()
    try:
        register_gin()
        gin_utils.parse_gin(["gin/dapo_fp8.gin"])
        assert gin_utils.memory_budget() is None
    finally:
        gin.clear_config()


@pytest.mark.slow
def test_cli_stops_with_one_line_before_anything_loads(qwen3_8b, tmp_path):
    """The shapes-only checkpoint has no weights: reaching the model load would be a different error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT")}
    proc = subprocess.run(
        [sys.executable, "-m", "portable_rl.train", "--gin_file=gin/dapo_fp8.gin", "--gin_file=gin/learner/mesh.gin",
         "--gin_file=gin/colocate.gin", f"--gin.MODEL_PATH={qwen3_8b}", f"--gin.RUN_DIR={tmp_path / 'run'}",
         "--gin.LEARNER_PEAK_GB=85.9", "--gin.DEVICE_MEMORY_GB=80.0", "--gin.MESH_FSDP=8"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "learner phase" in lines[0] and "LEARNER_PEAK_GB" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "[train]" not in proc.stdout
    assert not (tmp_path / "run").exists()  # stopped before the run directory was written


def test_the_7b_recipe_composes_with_colocate_gin(tmp_path, monkeypatch):
    """The run's own config feeds the plan, nothing set twice: the FP8 engine, its MAX_MODEL_LEN 10240 and
    tensor_parallel_size 8 (ENGINE_KWARGS), bf16 params + f32 master (rl.PrecisionConfig), fsdp 8 (the mesh)."""
    import gin

    from portable_rl import gin_utils
    from portable_rl.train import register_gin

    qwen2_5_7b = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                  "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                  "tie_word_embeddings": False}
    path = write_shapes_only_checkpoint(tmp_path / "qwen2_5_7b", qwen2_5_7b)
    for key in (PREALLOCATE, MEM_FRACTION, ALLOCATOR):
        monkeypatch.delenv(key, raising=False)
    gin.clear_config()
    try:
        register_gin()
        gin_utils.parse_gin(["gin/recipes/qwen2_5_7b_dapo_math_vllm_fp8.gin"],   # it includes gin/colocate.gin
                            [f"MODEL_PATH = '{path}'", "DATA_PATH = 'd.parquet'", "EVAL_DATA_PATH = 'e.parquet'",
                             "LEARNER_PEAK_GB = 68", "MESH_FSDP = 8",
                             "ENGINE_KWARGS = {'quantization': %QUANTIZATION, 'tensor_parallel_size': 8}",
                             "DEVICE_MEMORY_GB = 141.0"])
        budget = gin_utils.memory_budget()
    finally:
        gin.clear_config()
    params = 7_615_616_512  # Qwen/Qwen2.5-7B's published count
    assert budget.plan.quantization == "fp8" and budget.min_kv_tokens == 10240 and budget.plan.model_path == str(path)
    assert budget.plan.engine_tensor_parallel == 8 and budget.plan.learner_shards == 8
    assert budget.learner_resident_bytes == pytest.approx(params * 14 / 8)
    assert budget.engine_fraction == math.floor((141 * GB - params * 14 / 8 - 2 * GB) / (141 * GB) * 100) / 100


def test_gin_and_python_complete_the_plan_from_the_same_config(tmp_path):
    """gin (gin_utils.run_memory_plan) and a Python caller (MemoryPlan.for_run, as train() does for the checkpoint and
    dtypes) arrive at the same plan: nothing is repeated in gin/colocate.gin."""
    import gin

    from portable_rl import gin_utils
    from portable_rl.planning.engine import EngineSettings
    from portable_rl.rl.config import PrecisionConfig
    from portable_rl.train import register_gin

    gin.clear_config()
    try:
        register_gin()
        gin_utils.parse_gin(["gin/recipes/qwen2_5_7b_dapo_math_vllm_fp8.gin"],
                            ["MODEL_PATH = '/ckpt/qwen2_5_7b'", "DATA_PATH = 'd.parquet'", "EVAL_DATA_PATH = 'e.parquet'"])
        from_gin = gin_utils.run_memory_plan(learner_devices=8)
    finally:
        gin.clear_config()
    from_python = MemoryPlan(learner_peak_gb=64, sleep_engine=True).for_run(
        model_path="/ckpt/qwen2_5_7b", precision=PrecisionConfig(param_dtype="bfloat16", compute_dtype="bfloat16"),
        learner_shards=8, engine=EngineSettings("vllm", "fp8", 1, 10240, 0.6, True))
    assert from_gin == from_python
