"""The dry-run planner (`python -m portable_rl.plan`): the engine's sizes against published parameter counts,
the learner's depth extrapolation against a full compile, the gin traps it flags, one-line errors, and every
GPU launch command of the docs and every GPU recipe planned to fit at its stated hardware. The tests that compile
are marked slow (the recipes: 1-3 min each uncached on 2 loaded cores, cached by the request's hash afterwards;
the uncached ones all compile in one process, `recipes_compiled`)."""

import json
import re
import shlex
from pathlib import Path

import gin
import pytest

from portable_rl import plan as plan_cli
from portable_rl.planning.engine import engine_memory, param_counts
from portable_rl.planning.learner_peak import (COMPILED_LAYERS, PeakRequest, compile_in_subprocess, compile_missing,
                                               extrapolate)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "portable_rl" / "planning" / "configs"
FAKE_PATHS = ["--gin.MODEL_PATH=/nonexistent/ckpt", "--gin.DATA_PATH=/d.parquet", "--gin.EVAL_DATA_PATH=/e.parquet"]
# A recipe whose data is not DATA_PATH's: the paths it reads instead.
RECIPE_PATHS = {"qwen2_5_coder_7b_sql_vllm_fp8.gin": [
    "--gin.MODEL_PATH=/nonexistent/ckpt", "--gin.SQL_TRAIN_PATH=/t.parquet", "--gin.SQL_EVAL_PATH=/v.parquet",
    "--gin.SQL_DB_ROOT=/db"]}

# Every recipe in gin/recipes/: its stated hardware (gpus, gpu, shipped config, exported variables), or why it is
# not a GPU launch. A new recipe must be added here (test_every_recipe_has_stated_hardware).
GPU_RECIPES = {
    "qwen2_5_1_5b_dapo_math_1gpu.gin": (1, "h100", "qwen2.5-1.5b-instruct", {}),
    "qwen2_5_7b_dapo_math_vllm_fp8.gin": (8, "h100", "qwen2.5-7b", {}),
    "llama3_8b_dapo_math_vllm_fp8.gin": (8, "h100", "llama-3.1-8b-instruct", {}),
    "qwen3_8b_base_dapo_math_sglang_fp8.gin": (8, "h200", "qwen3-8b-base", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.62"}),
    "qwen2_5_32b_dapo_math_vllm_int8.gin": (16, "h100", "qwen2.5-32b", {}),
    "qwen2_5_coder_7b_sql_vllm_fp8.gin": (8, "h100", "qwen2.5-7b", {}),
    "qwen3_30b_a3b_dapo_vllm_fp8.gin": (16, "h200", "qwen3-30b-a3b", {}),
}
NOT_GPU_LAUNCHES = {
    "dapo_seed_settings.gin": "a fragment (algorithm settings)",
    "sequence_tis.gin": "a fragment (rollout correction)",
    "sequence_mask_trl.gin": "a fragment (rollout correction)",
    "smollm2_arith_fp8.gin": "a CPU recipe (vLLM-CPU)",
    "smollm2_arith_int8.gin": "a CPU recipe (vLLM-CPU)",
    "smollm2_sql_fp8.gin": "a CPU recipe (vLLM-CPU)",
}


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_engine_sizes_match_published_parameter_counts():
    published = {"qwen2.5-0.5b-instruct": 494_032_768, "qwen2.5-1.5b-instruct": 1_543_714_304,
                 "qwen2.5-7b": 7_615_616_512, "qwen2.5-32b": 32_763_876_352,
                 "llama-3.1-8b-instruct": 8_030_261_248, "qwen3-8b-base": 8_190_735_360,
                 "qwen3-30b-a3b": 30_532_122_624}
    for name, count in published.items():
        assert sum(param_counts(json.loads((CONFIGS / f"{name}.json").read_text()))) == count, name
    c = json.loads((CONFIGS / "qwen2.5-7b.json").read_text())
    bf16, fp8, fp8_tp8 = engine_memory(c, None, 1), engine_memory(c, "fp8", 1), engine_memory(c, "fp8", 8)
    assert bf16.weights == 2 * bf16.params
    proj, rest = param_counts(c)
    assert fp8.weights == proj + 2 * rest and fp8_tp8.weights == fp8.weights / 8
    assert bf16.kv_per_token == 2 * 28 * 4 * 128 * 2 and fp8_tp8.kv_per_token == bf16.kv_per_token / 8


def test_micro_batch_layout():
    from portable_rl.learner_jax.memory import MemoryConfig

    packed = MemoryConfig(max_tokens_per_micro_batch=16384)
    # 32 x 16 sequences over 8 shards = 64 per device, 3 of 5120 tokens per 16384-token row → 22 micro-batches
    assert plan_cli.micro_batch_layout(packed, sequences=512, shards=8, max_len=5120) == (1, 16384, 22)
    rows = MemoryConfig(max_tokens_per_micro_batch=16384, pack_sequences=False)
    assert plan_cli.micro_batch_layout(rows, sequences=512, shards=8, max_len=5000) == (2, 8192, 32)
    one_call = MemoryConfig(max_tokens_per_micro_batch=None)   # rows of the longest sequence, one micro-batch
    assert plan_cli.micro_batch_layout(one_call, sequences=128, shards=1, max_len=64) == (128, 64, 1)


@pytest.mark.slow  # ~30 s on an idle 2-core box, minutes under load
def test_extrapolated_learner_peak_bounds_the_full_compile():
    """1- and 2-layer compiles extrapolated to 4 layers (+ the margin on temp) against the 4-layer compile: one
    process with 2 host devices (fsdp 2), three compiles of a tiny Qwen3's train step."""
    hf = {"model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 384, "vocab_size": 512,
          "tie_word_embeddings": False}
    memory = dict(attention_impl="blockwise", pack_sequences=True, max_tokens_per_micro_batch=256,
                  logprob_chunk_tokens=128, remat="full", share_prompts=False)
    request = PeakRequest(hf_config=hf, mesh=(1, 2, 1, 1), memory=memory, rows=1, row_tokens=256, micro_batches=1)
    # the planner's own compile process (compile_in_subprocess: prod(mesh) = 2 host devices, LLVM's
    # optimizations skipped as in every plan: buffer assignment, the answer, is the same to the byte)
    one, two, full = compile_in_subprocess([request.with_layers(n) for n in (1, 2, 4)], timeout_s=600)
    extrapolated = extrapolate({1: one, 2: two}, 4)
    assert extrapolated["params_bytes"] == full["params_bytes"]          # state is exactly linear in layers
    assert extrapolated["optimizer_bytes"] == full["optimizer_bytes"]
    assert full["peak_bytes_per_device"] <= extrapolated["peak_bytes_per_device"] <= 1.3 * full["peak_bytes_per_device"]


def test_unused_macro_and_length_reset_are_flagged():
    from portable_rl import gin_utils
    from portable_rl.train import register_gin

    register_gin()
    files = ["gin/models/qwen2_5_7b.gin", "gin/engines/vllm.gin"]   # the trap: vllm.gin resets MAX_MODEL_LEN to 64
    gin_utils.parse_gin(files, ["MODEL_PATH = '/x'", "SEED = 0", "TEMPERATURE = 0.5"])
    assert "TEMPERATURE" in gin_utils.unused_macros()
    assert "MAX_MODEL_LEN" not in gin_utils.unused_macros()
    resets = gin_utils.length_resets(files, [], gin_utils.default_search_paths())
    assert len(resets) == 1 and resets[0].startswith("MAX_MODEL_LEN = 10240 (gin/models/qwen2_5_7b.gin) was reset to "
                                                     "64 by gin/engines/vllm.gin")
    # the other order, or a --gin binding that sets it last, is deliberate
    assert gin_utils.length_resets(files[::-1], [], gin_utils.default_search_paths()) == []
    assert gin_utils.length_resets(files, ["MAX_MODEL_LEN = 32"], gin_utils.default_search_paths()) == []
    # a recipe lowering what a file it includes set (MAX_RESPONSE_TOKENS 8192 of the model file → 3000)
    assert gin_utils.length_resets(["gin/recipes/qwen2_5_coder_7b_sql_vllm_fp8.gin"], [],
                                  gin_utils.default_search_paths()) == []


@pytest.mark.slow  # one tiny compile; ~15 s idle, minutes under load
def test_verdict_exit_status_and_changes_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    """The default CPU run's files, colocated, on a tiny Qwen3: fits a 20 GB device; on 5 GB the learner phase
    fits but the engine's allowance does not, and the planner names the changes."""
    monkeypatch.setenv("PORTABLE_RL_PLAN_CACHE", str(tmp_path / "cache"))
    hf = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
          "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    argv = ["--gin_file=gin/dapo_fp8.gin", "--gin_file=gin/colocate.gin", f"--gin.MODEL_PATH={tmp_path}", "--gpus", "1"]
    with pytest.raises(SystemExit) as e:
        plan_cli.main([*argv, "--device_memory_gb", "20", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert e.value.code == 0 and out["fits"] and out["layout"].startswith("colocated, time-shared")
    assert out["engine"]["quantization"] == "fp8_per_channel" and out["engine"]["max_model_len"] == 64
    gin.clear_config()
    with pytest.raises(SystemExit) as e:
        plan_cli.main([*argv, "--device_memory_gb", "5"])
    text = capsys.readouterr().out
    assert e.value.code == 2 and "verdict  DOES NOT FIT: engine needs 3.0 GB" in text, text
    assert "change: " in text
    # A bf16 AdamW first moment (make_optimizer's moment1_dtype) is planned: 2 bytes per parameter less state.
    gin.clear_config()
    with pytest.raises(SystemExit):
        plan_cli.main([*argv, "--gin.learner_jax.make_optimizer.moment1_dtype='bfloat16'", "--device_memory_gb", "20",
                       "--json"])
    bf16_mu = json.loads(capsys.readouterr().out)
    saved = (out["learner"]["state_gb"] - bf16_mu["learner"]["state_gb"]) * 1e9
    assert saved == pytest.approx(2 * out["params"], rel=1e-3), (saved, out["params"])


@pytest.mark.parametrize("args, message", [
    (["--gpu", "h900"], "--gpu='h900' is not a GPU the planner knows; use one of h100, h200"),
    (["--gpu", "h100"], "no config.json at MODEL_PATH=/nonexistent/ckpt: pass --model_config"),
    (["--gpu", "h100", "--model_config", "qwen9"], "--model_config=qwen9: no such config.json"),
])
def test_bad_input_is_one_line(args, message):
    argv = ["--gin_file=gin/recipes/qwen2_5_7b_dapo_math_vllm_fp8.gin", *FAKE_PATHS, "--gpus", "8", *args]
    with pytest.raises(SystemExit) as e:
        plan_cli.main(argv)
    assert str(e.value).startswith("error: ") and message in str(e.value) and "\n" not in str(e.value)


def test_every_recipe_has_stated_hardware():
    recipes = {p.name for p in (ROOT / "gin" / "recipes").glob("*.gin")}
    assert recipes == set(GPU_RECIPES) | set(NOT_GPU_LAUNCHES)


def doc_commands() -> list[tuple[str, dict, list[str]]]:
    """(where, exported variables, argv) of every `python -m portable_rl.train` command of README.md and docs/
    that runs a GPU recipe."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if "python -m portable_rl.train" not in line or "gin/recipes/" not in line:
                continue
            head, tail = line.split("python -m portable_rl.train", 1)
            env = dict(w.split("=", 1) for w in shlex.split(head.split("`")[-1]) if re.match(r"[A-Z_]+=", w))
            argv = [a for a in shlex.split(tail.split("`")[0]) if a != "..." and not a.startswith("[")]
            recipe = next(Path(a.split("=", 1)[1]).name for a in argv if a.startswith("--gin_file=gin/recipes/"))
            if recipe in GPU_RECIPES:
                out.append((f"{path.relative_to(ROOT)}: {recipe}", env, argv))
    return out


@pytest.mark.parametrize("family,extra", [
    ("qwen3_moe", dict(mlp_only_layers=[1])), ("qwen2_moe", dict(decoder_sparse_step=2)), ("qwen3_moe", {})])
def test_moe_total_and_active_params_match_transformers(family, extra):
    """Every expert counted in the total (transformers' own count of a tiny random model), K of E in the
    active count; dense layers (mlp_only_layers, decoder_sparse_step) keep their dense MLP."""
    import torch
    import transformers

    from portable_rl.planning.engine import active_param_count

    c = {"model_type": family, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 96, "num_experts": 6,
         "num_experts_per_tok": 2, "moe_intermediate_size": 20, "shared_expert_intermediate_size": 24,
         "tie_word_embeddings": False, **extra}
    cls = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM}[family]
    hf_config = transformers.AutoConfig.for_model(**c)
    with torch.device("meta"):
        hf_model = cls(hf_config)
    hf_total = sum(p.numel() for p in hf_model.parameters())
    proj, rest = param_counts(c)
    assert proj + rest == hf_total
    sparse = sum(hasattr(layer.mlp, "experts") for layer in hf_model.model.layers)
    assert sparse == (3 if not extra else 2 if "mlp_only_layers" in extra else 1)
    assert active_param_count(c) == hf_total - sparse * 3 * 32 * 20 * (6 - 2)
    published = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    assert active_param_count(published) == 3_353_032_704  # "3.3 B activated" (Qwen3 technical report)


def test_ragged_dot_stand_in_equals_equal_groups_and_is_linear_in_memory():
    """The planner's CPU stand-in for the GPU's ragged dot (planning/ragged_dot.py): the values and both
    gradients of `jax.lax.ragged_dot` when every group holds M / G rows; temporaries linear in the rows, where
    XLA:CPU's own lowering holds every group's copy; JAX's own lowering again after the context."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from portable_rl.planning.ragged_dot import grouped_matmul_stand_in

    def loss(x, w, sizes):
        return jnp.sum(jnp.sin(jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)))

    x, w = jax.random.normal(jax.random.key(0), (12, 5)), jax.random.normal(jax.random.key(1), (4, 5, 3))
    equal, unequal = jnp.full((4,), 3, jnp.int32), jnp.asarray([1, 6, 0, 5], jnp.int32)
    reference = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w, equal)
    with grouped_matmul_stand_in():
        stand_in = jax.jit(jax.value_and_grad(lambda *a: loss(*a) + 0.0, argnums=(0, 1)))(x, w, equal)
        rows, weights, sizes = (jax.ShapeDtypeStruct((8192, 256), jnp.bfloat16),
                                jax.ShapeDtypeStruct((64, 256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((64,), jnp.int32))
        grad = jax.jit(jax.grad(lambda *a: loss(*a) * 1.0, argnums=(0, 1)))
        linear = grad.lower(rows, weights, sizes).compile().memory_analysis().temp_size_in_bytes
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(stand_in)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    dense = jax.jit(jax.grad(lambda *a: loss(*a) * 2.0, argnums=(0, 1))).lower(
        rows, weights, sizes).compile().memory_analysis().temp_size_in_bytes
    assert linear < 8192 * 128 * 4 * 8 < dense  # a few [M, N] f32 buffers vs G = 64 copies
    after = jax.jit(lambda *a: loss(*a) * 3.0)(x, w, unequal)  # JAX's own lowering: exact for unequal groups
    starts = np.cumsum([0, 1, 6, 0])
    exact = sum(np.sin(np.asarray(x[s:s + n] @ w[g])).sum() for g, (s, n) in enumerate(zip(starts, [1, 6, 0, 5])))
    np.testing.assert_allclose(float(after), 3.0 * exact, rtol=1e-5)


def plan_argv(recipe: str, extra=()) -> tuple[list[str], dict]:
    gpus, gpu, config, env = GPU_RECIPES[recipe]
    return [f"--gin_file=gin/recipes/{recipe}", *RECIPE_PATHS.get(recipe, FAKE_PATHS), *extra, "--gpus", str(gpus),
            "--gpu", gpu,
            "--model_config", config], env


def doc_plan_argv(argv) -> list[str]:
    """The planner's flags for a doc command: its gin files and bindings (the test's paths instead of the doc's),
    and its recipe's stated hardware."""
    recipe = next(Path(a.split("=", 1)[1]).name for a in argv if a.startswith("--gin_file=gin/recipes/"))
    base, _ = plan_argv(recipe)
    paths = RECIPE_PATHS.get(recipe, FAKE_PATHS)
    flags = [a for a in argv if a.startswith("--gin_file")] + paths + [
        a for a in argv if a.startswith("--gin.") and a.split("=")[0] not in
        {p.split("=")[0] for p in paths} | {"--gin.RUN_DIR"}]
    return flags + base[base.index("--gpus"):]


class _Planned(Exception):
    """The learner request a plan reached (recipes_compiled stops the plan there)."""


@pytest.fixture(scope="module")
def recipes_compiled(request):
    """The learner compiles of the recipe plans this session runs (the selected recipe cases; every doc command
    when test_doc_launch_commands_fit is selected), cached up front in ONE process: one JAX start and import
    instead of one per recipe (learner_peak.compile_missing). The tests then plan through the cache."""
    items = [item for item in request.session.items if item.path == Path(__file__).resolve()]
    plans = [plan_argv(item.callspec.params["recipe"]) for item in items
             if item.originalname == "test_recipe_fits_its_stated_hardware"]
    if any(item.originalname == "test_doc_launch_commands_fit" for item in items):
        plans += [(doc_plan_argv(argv), env) for _, env, argv in doc_commands()]

    def stop(learner_request, layers):
        assert layers == COMPILED_LAYERS
        raise _Planned(learner_request)

    requests = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_cli, "predict_peak_in_subprocess", stop)
        for argv, env in plans:
            gin.clear_config()
            with pytest.raises(_Planned) as planned:
                plan_cli.run_plan(argv, environ=env)
            requests.append(planned.value.args[0])
    gin.clear_config()
    try:
        compile_missing(requests)
    except RuntimeError:
        pass  # one request failed to compile: each test compiles its own and names its recipe


def assert_fits(argv, env):
    result = plan_cli.run_plan(argv, environ=env)
    text = "\n".join(result.lines)
    assert result.fits, text
    assert not result.data["warnings"], text
    return result


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(GPU_RECIPES))
def test_recipe_fits_its_stated_hardware(recipe, recipes_compiled):
    """XLA compiles at 1 and 2 layers of the real widths (~1 min each recipe; cached by the request's hash)."""
    argv, env = plan_argv(recipe)
    result = assert_fits(argv, env)
    peak_gb = result.data["learner"]["peak_gb"]
    header = (ROOT / "gin" / "recipes" / recipe).read_text()
    stated = re.search(r"^LEARNER_PEAK_GB = (\d+)", header, re.M)
    if stated:  # the run-time plan's peak must not be below the planned one
        assert int(stated.group(1)) >= peak_gb
    assert f"learner peak {peak_gb:.1f} GB" in header, "the recipe's header quotes the planner's numbers"


@pytest.mark.slow
def test_doc_launch_commands_fit(recipes_compiled):
    commands = doc_commands()
    assert len(commands) >= 4, "README.md / docs/ have GPU launch commands"
    for where, env, argv in commands:
        gin.clear_config()
        result = plan_cli.run_plan(doc_plan_argv(argv), environ=env)
        assert result.fits and not result.data["warnings"], f"{where}: " + "\n".join(result.lines)
