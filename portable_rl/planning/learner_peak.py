"""The learner's per-device peak memory of ONE update, from XLA's compile of the real update on abstract shapes.

The model and optimizer are built with `nnx.eval_shape` in the run's dtypes (`rl.PrecisionConfig`: e.g. bf16
params, f32 master + AdamW moments through `optim.with_master_weights`), every leaf a `jax.ShapeDtypeStruct`
with its mesh `NamedSharding` (`learner_jax/sharding.py`), the batch `ShapeDtypeStruct`s split by rows, and
each jitted function of one update (`learner_jax/step.py`: the train step for one micro-batch, else the grad
step + the apply step with the f32 accumulator resident) is `lower(...).compile()`d for a mesh of host CPU
devices. Per function f, `f.memory_analysis()` gives per-device argument, output, aliased and temp bytes:

    live(f)  = argument + output - alias + temp + (persistent state that is not an argument of f)
    peak     = max over the functions f of one update of live(f)
    persistent state = params + optimizer state (+ the gradient accumulator with > 1 micro-batch)

Mixture-of-experts models: every expert's weights and optimizer state are counted (all are resident, split over
the `expert` and `fsdp` axes), and the expert matmuls are compiled as the GPU's ragged dot rather than
XLA:CPU's dense fallback, which would hold every expert's copy of the rows (planning/ragged_dot.py).

Nothing is allocated: an 8B model "fits" a laptop. The compile is XLA:CPU's. GSPMD partitions and buffer
liveness are the same machinery as XLA:GPU's, but XLA:CPU upcasts some bf16 dots to f32 and schedules
differently: read the numbers as an upper-side estimate of the GPU's (docs/scaling.md, "Learner memory").

Depth. Compiling a 36-layer 8B update takes 10-60 min on 2 CPU cores; every byte above is linear in the
number of layers L (per-layer weights, state and saved residuals; the head, the embedding and one layer's
recomputation are constant), so `predict_peak` compiles L = 1 and L = 2 (same widths) and extrapolates each
function's parts:

    x(L) = x(1) + (L - 1) · (x(2) - x(1))        for x in argument, output, alias, temp, params, optimizer

tests/test_plan.py checks it against the full compile of a small model. A full 36-layer Qwen3-8B compile
came out 12-25 % above a 2/4-layer extrapolation (docs/scaling.md), so the planner adds
`EXTRAPOLATION_MARGIN` to the extrapolated temporaries.

Host devices must be requested before JAX starts its CPU backend, so `predict_peak_in_subprocess` runs this
module (`python -m portable_rl.planning.learner_peak`, JSON requests on stdin, the JSON answers on stdout) in
a fresh process with `--xla_force_host_platform_device_count` = the mesh's size, and caches the answer by the
request's hash (`PORTABLE_RL_PLAN_CACHE`, default ~/.cache/portable_rl/plan). `compile_missing` compiles the
uncached requests of several plans in one such process (as many devices as the largest mesh).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from portable_rl.planning.ragged_dot import grouped_matmul_stand_in

EXTRAPOLATION_MARGIN = 0.25   # added to the extrapolated temp bytes (module doc)
COMPILED_LAYERS = (1, 2)
OPTIM = dict(learning_rate=1e-6, weight_decay=0.1, max_grad_norm=1.0)   # AdamW; its settings do not change memory
INT_FIELDS = ("input_ids", "segment_ids", "positions")
FLOAT_FIELDS = ("response_mask", "keep_mask", "old_logprobs", "rollout_logprobs", "advantages", "tis_weights",
                "token_weights")
PARTS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")


@dataclasses.dataclass(frozen=True)
class PeakRequest:
    """One update to compile: the model (an HF config.json dict), the learner mesh, the memory knobs
    (`learner_jax.MemoryConfig` fields), the micro-batch layout per device and the dtypes (`rl.PrecisionConfig`)."""

    hf_config: dict
    mesh: tuple                # (data, fsdp, expert, tensor)
    memory: dict               # learner_jax.MemoryConfig fields
    rows: int                  # rows per device of one micro-batch
    row_tokens: int            # tokens per row
    micro_batches: int         # > 1: the grad step + apply step with the f32 accumulator
    param_dtype: str = "bfloat16"
    master_dtype: Optional[str] = "float32"
    compute_dtype: str = "bfloat16"
    moment1_dtype: Optional[str] = None   # make_optimizer's: AdamW's first moment (None: the master dtype)

    def with_layers(self, layers: int) -> "PeakRequest":
        return dataclasses.replace(self, hf_config={**self.hf_config, "num_hidden_layers": layers})

    def key(self) -> str:
        """The cache key: the request, JAX's version and the source of the code compiled (a change to the
        model, the loss or the steps invalidates every cached answer)."""
        import jax

        text = json.dumps({**dataclasses.asdict(self), "jax": jax.__version__, "code": code_digest()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


def code_digest() -> str:
    """sha256 of the learner's source: learner_jax/, rl/learner.py, this module and the ragged-dot stand-in."""
    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "learner_jax").glob("*.py")) + [root / "rl" / "learner.py", Path(__file__).resolve(),
                                                           root / "planning" / "ragged_dot.py"]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


# --------------------------------------------------------------------------------------- abstract state
def device_bytes(x) -> int:
    """Bytes of one device's shard of a ShapeDtypeStruct / array with a sharding."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return math.prod(shape) * x.dtype.itemsize


def tree_device_bytes(tree) -> int:
    import jax

    return sum(device_bytes(x) for x in jax.tree.leaves(tree))


def abstract_model_and_optimizer(config, mesh, *, model_kwargs, param_dtype="bfloat16", master_dtype="float32",
                                 compute_dtype="bfloat16", moment1_dtype=None):
    """(model, optimizer) whose arrays are sharded ShapeDtypeStructs, built as `train.build_run` builds them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.learner_jax.model import Transformer
    from portable_rl.learner_jax.optim import make_optimizer, with_master_weights
    from portable_rl.learner_jax.sharding import state_shardings

    def create():
        model = Transformer(config, param_dtype=jnp.dtype(param_dtype), compute_dtype=jnp.dtype(compute_dtype),
                            rngs=nnx.Rngs(0), **model_kwargs)
        tx = make_optimizer(**OPTIM, moment1_dtype=moment1_dtype)
        if master_dtype and jnp.dtype(master_dtype) != jnp.dtype(param_dtype):
            tx = with_master_weights(tx, jnp.dtype(master_dtype))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(create)
    for module in (model, optimizer):
        state = nnx.state(module)
        shardings = state_shardings(state, mesh)
        nnx.update(module, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                        state, shardings))
    return model, optimizer


def abstract_batch(mesh, rows_per_device: int, seq: int, fields: dict):
    """{name: ShapeDtypeStruct [batch shards * rows_per_device, seq]} split by rows over the batch axes."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from portable_rl.learner_jax.sharding import LOGICAL_AXIS_RULES, batch_shards

    rows = rows_per_device * batch_shards(mesh)
    sharding = NamedSharding(mesh, PartitionSpec(dict(LOGICAL_AXIS_RULES)["batch"]))
    return {k: jax.ShapeDtypeStruct((rows, seq), dtype, sharding=sharding) for k, dtype in fields.items()}


def compile_stats(name: str, jitted, *args) -> dict:
    """Lower + compile `jitted(*args)`; its per-device memory_analysis numbers and compile seconds."""
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    return {"name": name, "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "xla_peak_memory_in_bytes": int(getattr(m, "peak_memory_in_bytes", -1)),
            "compile_seconds": seconds}


def combine(functions: list[dict], persistent_bytes: int) -> dict:
    """peak = max_f (argument + output - alias + temp + persistent state not among f's arguments)."""
    for f in functions:
        f["live_bytes"] = (f["argument_bytes"] + f["output_bytes"] - f["alias_bytes"] + f["temp_bytes"]
                           + persistent_bytes - f["persistent_argument_bytes"])
    worst = max(functions, key=lambda f: f["live_bytes"])
    return {"peak_bytes_per_device": worst["live_bytes"], "peak_function": worst["name"],
            "temp_bytes": worst["temp_bytes"], "argument_bytes": worst["argument_bytes"],
            "output_bytes": worst["output_bytes"], "alias_bytes": worst["alias_bytes"],
            "compile_seconds": sum(f["compile_seconds"] for f in functions), "functions": functions}


def apply_stats(apply_step, model, optimizer, grad_sum, persistent: int) -> list[dict]:
    """compile_stats of the optimizer update: the one `apply_step` call, or each distinct call of a
    `LayerwiseApplyStep` (the norm, then one per kind of group), whose arguments are parts of the persistent
    state (its other parts stay resident alongside)."""
    import jax
    import jax.numpy as jnp

    from portable_rl.learner_jax.step import LayerwiseApplyStep

    if not isinstance(apply_step, LayerwiseApplyStep):
        a = compile_stats("apply_step", apply_step, model, optimizer, grad_sum)
        a["persistent_argument_bytes"] = persistent
        return [a]
    params, opt_state, _, grads = apply_step.pure_arrays(model, optimizer, grad_sum)
    norm = compile_stats("apply_step/norm", apply_step.norm, grads)
    norm["persistent_argument_bytes"] = tree_device_bytes(grads)
    out, seen = [norm], set()
    p, s, g = jax.tree.leaves(params), jax.tree.leaves(opt_state), jax.tree.leaves(grads)
    fn = apply_step.group_update(optimizer.tx)
    for call in apply_step.plan(params, opt_state):
        if call.spec in seen:  # the same compilation as an earlier group's (and the same bytes)
            continue
        seen.add(call.spec)
        args = call.arguments(p, s, g)
        a = compile_stats(f"apply_step/{'.'.join(map(str, call.group))}", fn, call.spec, *args,
                          jax.ShapeDtypeStruct((), jnp.float32))
        a["persistent_argument_bytes"] = tree_device_bytes(args)
        out.append(a)
    return out


def compile_update(steps: dict, model, optimizer, batch, grad_sum=None) -> dict:
    """Compiles what `rl.learner.Learner.update` runs for one mini-batch and combines each function's
    memory_analysis (module doc): `steps["train_step"]` when `grad_sum` is None (one micro-batch), else
    `steps["grad_step"]` + `steps["apply_step"]` with the f32 accumulator `grad_sum` resident. The arguments
    may be abstract (sharded ShapeDtypeStructs) or the real arrays, whose compilations a later call reuses."""
    from flax import nnx

    # the optimizer's state: step counter + opt_state (nnx.Optimizer holds no model reference)
    params, opt = tree_device_bytes(nnx.state(model, nnx.Param)), tree_device_bytes(nnx.state(optimizer))
    if grad_sum is None:
        f = compile_stats("train_step", steps["train_step"], model, optimizer, batch)
        f["persistent_argument_bytes"] = params + opt
        functions, grads = [f], 0
    else:
        grads = tree_device_bytes(grad_sum)
        g = compile_stats("grad_step", steps["grad_step"], model, batch, grad_sum)
        g["persistent_argument_bytes"] = params + grads
        functions = [g, *apply_stats(steps["apply_step"], model, optimizer, grad_sum, params + opt + grads)]
    return {**combine(functions, params + opt + grads), "params_bytes": params, "optimizer_bytes": opt,
            "grad_accumulator_bytes": grads}


def rl_cfg():
    """The DAPO settings the loss reads (clip-higher, token-mean); they do not change the update's memory."""
    from portable_rl.rl.dapo import dapo_config

    return dapo_config(prompt_batch_size=32, n_samples=16, mini_batch_size=32, clip_eps_low=0.2,
                       clip_eps_high=0.28, loss_aggregation="token-mean")


def predict_update_memory(config, mesh, memory, *, rows: int, row_tokens: int, micro_batches: int,
                          param_dtype="bfloat16", master_dtype="float32", compute_dtype="bfloat16",
                          moment1_dtype=None) -> dict:
    """Per-device peak of one update (module doc) of `config` (a ModelConfig) under `memory` (a MemoryConfig),
    micro-batches of [rows, row_tokens] per device: `compile_update` of the learner's step functions on abstract
    sharded shapes, for `mesh`'s backend. Call it under `jax.set_mesh(mesh)`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.learner_jax import step as step_lib
    from portable_rl.rl.learner import make_loss_fn

    model, optimizer = abstract_model_and_optimizer(
        config, mesh, model_kwargs=memory.model_kwargs(),
        param_dtype=param_dtype, master_dtype=master_dtype, compute_dtype=compute_dtype,
        moment1_dtype=moment1_dtype)
    fields = {**{k: jnp.int32 for k in INT_FIELDS}, **{k: jnp.float32 for k in FLOAT_FIELDS}}
    batch = abstract_batch(mesh, rows, row_tokens, fields)
    loss_fn = make_loss_fn(rl_cfg().loss, 1.0, memory.logprob_chunk_tokens)
    steps = dict(train_step=step_lib.make_train_step(loss_fn), grad_step=step_lib.make_grad_step(loss_fn),
                 apply_step=step_lib.make_apply_step(memory.update_by_layer))
    # with update_by_layer the learner always accumulates (the update is its own calls, rl/learner.py)
    grad_sum = None if micro_batches == 1 and not memory.update_by_layer else jax.tree.map(  # step.zero_grads, abstractly
        lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding), nnx.state(model, nnx.Param))
    with grouped_matmul_stand_in():  # MoE: the GPU's ragged dot, not XLA:CPU's dense one (planning/ragged_dot.py)
        out = compile_update(steps, model, optimizer, batch, grad_sum)
    out.update(micro_batches=micro_batches, rows_per_device=rows, row_tokens=row_tokens,
               knobs={"attention_impl": memory.attention_impl, "pack_sequences": memory.pack_sequences,
                      "max_tokens_per_micro_batch": memory.max_tokens_per_micro_batch,
                      "logprob_chunk_tokens": memory.logprob_chunk_tokens, "remat": memory.remat,
                      "moe_dispatch": memory.moe_dispatch, "update_by_layer": memory.update_by_layer})
    return out


# ------------------------------------------------------------------------------------- the planner's call
def compile_request(request: PeakRequest) -> dict:
    """`predict_update_memory` of `request` in this process (it must see prod(mesh) JAX devices)."""
    import jax

    from portable_rl.learner_jax.config import ModelConfig
    from portable_rl.learner_jax.memory import MemoryConfig
    from portable_rl.learner_jax.sharding import MeshConfig, make_mesh

    size = math.prod(request.mesh)
    if len(jax.devices()) < size:
        raise RuntimeError(f"JAX sees {len(jax.devices())} devices, the mesh needs {size}: use "
                           "predict_peak_in_subprocess (host devices are set before JAX starts)")
    data, fsdp, expert, tensor = request.mesh
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, expert=expert, tensor=tensor), devices=jax.devices()[:size])
    memory = MemoryConfig(**request.memory)
    with jax.set_mesh(mesh):  # the model pins activations' rows to it (sharding.constrain_batch_rows)
        return predict_update_memory(ModelConfig.from_hf_dict(request.hf_config), mesh, memory, rows=request.rows,
                                     row_tokens=request.row_tokens, micro_batches=request.micro_batches,
                                     param_dtype=request.param_dtype, master_dtype=request.master_dtype,
                                     compute_dtype=request.compute_dtype, moment1_dtype=request.moment1_dtype)


def extrapolate(at: dict[int, dict], layers: int) -> dict:
    """The full depth's numbers from the compiles at `COMPILED_LAYERS` (module doc), per function; the temp
    bytes get `EXTRAPOLATION_MARGIN`. `at`: {layers: compile_request's answer}."""
    (l1, r1), (l2, r2) = sorted(at.items())
    lin = lambda a, b: a + (layers - l1) * (b - a) / (l2 - l1)  # noqa: E731
    state = {k: int(lin(r1[k], r2[k])) for k in ("params_bytes", "optimizer_bytes", "grad_accumulator_bytes")}
    persistent = sum(state.values())
    functions = []
    for f1, f2 in zip(r1["functions"], r2["functions"]):
        f = {"name": f1["name"], **{k: int(lin(f1[k], f2[k])) for k in PARTS + ("persistent_argument_bytes",)}}
        f["temp_bytes"] = int(f["temp_bytes"] * (1 + EXTRAPOLATION_MARGIN))
        f["compile_seconds"] = f1["compile_seconds"] + f2["compile_seconds"]
        functions.append(f)
    out = combine(functions, persistent)
    return {**out, **state, "layers": layers, "compiled_layers": sorted(at),
            "extrapolation_margin": EXTRAPOLATION_MARGIN}


def cache_dir() -> Path:
    return Path(os.environ.get("PORTABLE_RL_PLAN_CACHE", Path.home() / ".cache" / "portable_rl" / "plan"))


def compile_in_subprocess(requests: list[PeakRequest], timeout_s: float = 1800) -> list[dict]:
    """`compile_request` of each request, in one fresh process with as many host devices as the largest mesh
    (each mesh takes the first prod(mesh) of them)."""
    # The executables are never run: LLVM's optimizations only cost time (a quarter of each compile) and do not
    # touch buffer assignment, whose bytes are the answer (the same to the byte with and without them).
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                        f"{max(math.prod(r.mesh) for r in requests)}").strip()
    payload = json.dumps([dataclasses.asdict(r) for r in requests])
    proc = subprocess.run([sys.executable, "-m", "portable_rl.planning.learner_peak"], input=payload,
                          capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode:
        raise RuntimeError(f"learner compile failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_missing(requests: list[PeakRequest], layers=COMPILED_LAYERS, timeout_s: float = 1800) -> None:
    """Caches the compiles of `requests` at `layers` (None: the full depth) that the cache lacks, all in one
    process: several plans pay one process start and JAX import instead of one each."""
    missing = []
    for request in requests:
        for n in [request.hf_config["num_hidden_layers"]] if layers is None else layers:
            r = request.with_layers(n)
            if not (cache_dir() / f"{r.key()}.json").exists() and r not in missing:
                missing.append(r)
    if missing:
        results = compile_in_subprocess(missing, timeout_s)
        cache_dir().mkdir(parents=True, exist_ok=True)
        for r, result in zip(missing, results):
            (cache_dir() / f"{r.key()}.json").write_text(json.dumps(result))


def predict_peak_in_subprocess(request: PeakRequest, layers=COMPILED_LAYERS, timeout_s: float = 1800) -> dict:
    """The full-depth peak of `request` (module doc): compiles at `layers` (one fresh process, prod(mesh) host
    devices) and extrapolates; `layers=None` compiles the full depth once (no extrapolation). Cached."""
    compile_missing([request], layers, timeout_s)
    full = request.hf_config["num_hidden_layers"]
    at = {n: json.loads((cache_dir() / f"{request.with_layers(n).key()}.json").read_text())
          for n in ([full] if layers is None else layers)}
    if layers is None:
        return {**at[full], "layers": full, "compiled_layers": [full], "extrapolation_margin": 0.0}
    return extrapolate(at, full)


def main():
    """stdin: a JSON list of PeakRequest dicts; stdout (last line): the list of their compile answers."""
    requests = [PeakRequest(**{**d, "mesh": tuple(d["mesh"])}) for d in json.loads(sys.stdin.read())]
    print(json.dumps([compile_request(r) for r in requests]), flush=True)


if __name__ == "__main__":
    main()
