"""Will this run fit its GPUs? A dry run of `portable_rl.train`'s memory, before anything starts.

    python -m portable_rl.plan --gin_file=gin/recipes/qwen2_5_7b_dapo_math_vllm_fp8.gin --gin.MODEL_PATH=... \\
        --gin.DATA_PATH=... --gin.EVAL_DATA_PATH=... --gpus 8 --gpu h100 [--model_config qwen2.5-7b]

Takes the run's own flags (the same --gin_file / --gin.NAME=VALUE as train) plus the hardware, starts no
engine and allocates no accelerator memory. Per device it prints:

  learner   the peak of one update from XLA's compile of the real update on abstract shapes
            (planning/learner_peak.py: 1- and 2-layer compiles extrapolated to the full depth), and what the
            compile assumed: the mesh over the GPUs, the micro-batch layout, remat, attention, dtypes;
  engine    weights, the KV cache of one MAX_MODEL_LEN sequence and of the whole generation batch, the
            activation reserve, for every quantization, over the engine's tensor_parallel_size
            (planning/engine.py);
  layout    colocated (gin/colocate.gin: `rl.colocation.MemoryPlan`, time-shared or resident), or the
            default one (XLA preallocates 75 % of every GPU, the engine asks its own share of GPU 0..t-1);
  verdict   fits, or why not and the smallest change that makes it fit (micro-batch tokens, remat, the
            engine's tensor_parallel_size, SLEEP_ENGINE, GPU count);
  warnings  macros bound and never read, and a length macro lowered by a later-included file.

The model's dimensions come from MODEL_PATH/config.json, or `--model_config` (a config.json path, or the name of
one shipped in portable_rl/planning/configs/ for the recipes' public models: their published dimensions).
Exported XLA_PYTHON_CLIENT_* variables count, as they do in the run. Bad input ends with one line naming the
fix. `--json` prints the whole plan as one JSON object. Exit status: 0 fits, 2 does not fit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Mapping, Optional

from portable_rl import gin_utils
from portable_rl.errors import ConfigError, UserError
from portable_rl.planning.engine import EngineSettings, active_param_count, engine_memory
from portable_rl.planning.gpus import gpu_memory_gb
from portable_rl.planning.learner_peak import PeakRequest, predict_peak_in_subprocess

GB = 1e9
CONFIGS_DIR = Path(__file__).resolve().parent / "planning" / "configs"
XLA_DEFAULT_FRACTION = 0.75   # XLA_PYTHON_CLIENT_MEM_FRACTION's default: XLA preallocates it at its first use
VLLM_DEFAULT_UTILIZATION = 0.9


# ------------------------------------------------------------------------------------------- the model
def load_model_config(model_config: Optional[str], model_path: Optional[str]) -> tuple[dict, str]:
    """(config.json dict, where it came from): --model_config (a path or a shipped name), else MODEL_PATH's."""
    if model_config:
        shipped = CONFIGS_DIR / f"{model_config}.json"
        path = shipped if shipped.exists() else Path(model_config)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            names = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.json")))
            raise ConfigError(f"--model_config={model_config}: no such config.json; give a path or one of {names}")
    else:
        path = Path(str(model_path)) / "config.json"
        if not path.exists():
            names = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.json")))
            raise ConfigError(f"no config.json at MODEL_PATH={model_path}: pass --model_config=PATH/config.json, or "
                              f"the name of a shipped one ({names})")
    return json.loads(path.read_text()), str(path)


# ------------------------------------------------------------------------------------------- the learner
def micro_batch_layout(memory, *, sequences: int, shards: int, max_len: int) -> tuple[int, int, int]:
    """(rows, row tokens, micro-batches) of one mini-batch per device, every sequence at its longest
    (`max_len` = prompt + response): the largest micro-batch the learner can meet."""
    from portable_rl.rl.batching import packed_row_length

    per_shard = math.ceil(sequences / shards)
    budget = memory.max_tokens_per_micro_batch
    if memory.pack_sequences:
        if budget is None:  # one micro-batch: rows as long as the longest sequence, one full-length sequence each
            return per_shard, packed_row_length(max_len), 1
        return 1, budget, math.ceil(per_shard / max(1, budget // max_len))
    row = 1 << (max_len - 1).bit_length()   # one sequence per row, padded to a power of two
    rows = max(1, (budget or per_shard * row) // row)
    return rows, row, math.ceil(per_shard / rows)


# ------------------------------------------------------------------------------------------- planning
@dataclasses.dataclass
class Plan:
    """What `plan` found: the printed lines, the verdict, and the numbers (`--json`)."""

    lines: list
    fits: bool
    data: dict


def plan(*, hf: dict, model_source: str, gpus: int, device_gb: float, precision, memory, mesh_cfg, dapo,
         engine: EngineSettings, memory_plan, environ: Mapping[str, str],
         full_compile: bool = False, moment1_dtype: Optional[str] = None) -> Plan:
    """The plan of a run (module doc) from its config objects; compiles the learner update (cached).
    moment1_dtype: `learner_jax.make_optimizer`'s (AdamW's first moment; None: the master dtype)."""
    from portable_rl.learner_jax.sharding import mesh_shape
    from portable_rl.rl.colocation import Footprint, MemoryPlan, MemoryPlanError

    if memory_plan is not None and engine.name != "vllm":
        raise ConfigError(f"gin/colocate.gin plans a vLLM engine's gpu_memory_utilization, not {engine.name}'s; drop "
                          "gin/colocate.gin and bound both sides yourself: export XLA_PYTHON_CLIENT_MEM_FRACTION and set "
                          "the engine's memory share (SGLang: mem_fraction_static in ENGINE_KWARGS)")
    m = device_gb * GB
    lines, warnings = [], []
    learner_devices = gpus if mesh_cfg is not None else 1
    mesh = mesh_shape(mesh_cfg, learner_devices) if mesh_cfg is not None else (1, 1, 1, 1)  # data, fsdp, expert, tensor
    shards = mesh[0] * mesh[1] * mesh[2]  # the batch's rows split over data, fsdp and expert
    gen, loss = dapo.generation, dapo.loss
    max_len = engine.max_model_len
    if max_len < gen.max_response_tokens:
        warnings.append(f"MAX_MODEL_LEN={max_len} < max_response_tokens={gen.max_response_tokens}: the engine cannot "
                        "hold a full answer; set MAX_MODEL_LEN to the longest prompt + MAX_RESPONSE_TOKENS")
    budget = memory.max_tokens_per_micro_batch
    if budget is not None and budget < max_len:
        warnings.append(f"learner_jax.MemoryConfig.max_tokens_per_micro_batch={budget} < MAX_MODEL_LEN={max_len}: a "
                        "full-length sequence would stop the run (sequences are never split); raise it")
    rows, row_tokens, micro = micro_batch_layout(memory, sequences=loss.mini_batch_size * gen.n_samples,
                                                 shards=shards, max_len=max_len)
    compiled_memory = {f.name: getattr(memory, f.name) for f in dataclasses.fields(memory)}
    if compiled_memory["attention_impl"] in ("auto", "cudnn", "splash"):
        compiled_memory["attention_impl"] = "blockwise"   # XLA:CPU's linear-memory attention stands in
    compiled_memory["share_prompts"] = False
    request = PeakRequest(hf_config=hf, mesh=tuple(mesh), memory=compiled_memory, rows=rows, row_tokens=row_tokens,
                          micro_batches=micro, param_dtype=precision.param_dtype, master_dtype=precision.master_dtype,
                          compute_dtype=precision.compute_dtype, moment1_dtype=moment1_dtype)
    learner = predict_peak_in_subprocess(request, layers=None if full_compile else (1, 2))
    peak = learner["peak_bytes_per_device"]
    state = learner["params_bytes"] + learner["optimizer_bytes"]
    grads = learner["grad_accumulator_bytes"]
    temp_part = peak - state - grads
    em = engine_memory(hf, engine.quantization, engine.tensor_parallel)
    costs = memory_plan or MemoryPlan(learner_peak_gb=None)   # the engine's and the runtime's allowances
    overhead_gb, asleep_gb, reserve_gb = costs.engine_overhead_gb, costs.engine_asleep_gb, costs.reserve_gb
    batch_seqs = dapo.data.prompt_batch_size * gen.n_samples

    active = active_param_count(hf)
    moe = (f" ({active / 1e9:.2f} B active: top-{hf['num_experts_per_tok']} of "
           f"{hf.get('num_experts', hf.get('num_local_experts'))} experts)" if active != em.params else "")
    lines.append(f"model    {model_source}: {em.params / 1e9:.2f} B params{moe}, {hf['num_hidden_layers']} layers, "
                 f"hidden {hf['hidden_size']}, vocab {hf['vocab_size']}")
    lines.append(f"hardware {gpus} x {device_gb:.1f} GB")
    lines.append(f"learner  mesh data={mesh[0]} fsdp={mesh[1]} expert={mesh[2]} tensor={mesh[3]} over {learner_devices} device(s); "
                 f"micro-batch {rows} x {row_tokens} tokens/device, {micro} per mini-batch of "
                 f"{loss.mini_batch_size} x {gen.n_samples} sequences at MAX_MODEL_LEN {max_len}; remat "
                 f"{memory.remat}, attention {memory.attention_impl} (compiled as {compiled_memory['attention_impl']}), "
                 f"head chunk {memory.logprob_chunk_tokens}; params {precision.param_dtype}, master "
                 f"{precision.master_dtype}, compute {precision.compute_dtype}")
    how = ("full compile" if full_compile else
           f"XLA:CPU compiles at {learner['compiled_layers']} layers extrapolated to {learner['layers']}, "
           f"temp +{learner['extrapolation_margin']:.0%}")
    lines.append(f"         peak {peak / GB:.1f} GB/device in {learner['peak_function']}: state {state / GB:.1f} "
                 f"(params {learner['params_bytes'] / GB:.1f} + optimizer {learner['optimizer_bytes'] / GB:.1f}) + "
                 f"gradient accumulator {grads / GB:.1f} + activations/temp {temp_part / GB:.1f} ({how})")
    per_q = ", ".join(f"{q or 'bf16'} {engine_memory(hf, q, engine.tensor_parallel).weights / GB:.1f}"
                      for q in (None, "fp8", "int8_per_channel"))
    lines.append(f"engine   {engine.name} {engine.quantization or 'bf16'}, tensor_parallel {em.tensor_parallel}: weights "
                 f"{em.weights / GB:.2f} GB/device (bf16 / fp8 / int8: {per_q}); KV {em.kv_per_token / 1e6:.3f} "
                 f"MB/token/device: one {max_len}-token sequence {max_len * em.kv_per_token / GB:.2f} GB, the "
                 f"generation batch ({batch_seqs} x {max_len}) {batch_seqs * max_len * em.kv_per_token / GB:.1f} GB; "
                 f"activation reserve {overhead_gb:.1f} GB")

    data = {"gpus": gpus, "device_gb": device_gb, "mesh": list(mesh), "params": em.params, "active_params": active,
            "learner": {
        "peak_gb": peak / GB, "state_gb": state / GB, "grad_accumulator_gb": grads / GB, "temp_gb": temp_part / GB,
        "micro_batch": [rows, row_tokens, micro], "compile": how},
        "engine": {"name": engine.name, "quantization": engine.quantization, "tensor_parallel": em.tensor_parallel,
                   "weights_gb": em.weights / GB, "kv_mb_per_token": em.kv_per_token / 1e6,
                   "max_model_len": max_len}}
    fits, why, suggestions = True, "", []
    if engine.tensor_parallel > gpus:
        fits, why = False, f"the engine's tensor_parallel_size {engine.tensor_parallel} > {gpus} GPUs"
    if memory_plan is not None:   # colocated: gin/colocate.gin's MemoryPlan, with the sizes planned here
        mp = dataclasses.replace(memory_plan, learner_peak_gb=peak / GB, device_memory_gb=device_gb)
        if memory_plan.learner_peak_gb is not None and memory_plan.learner_peak_gb * GB < peak:
            warnings.append(f"LEARNER_PEAK_GB={memory_plan.learner_peak_gb} is below the planned peak {peak / GB:.1f}; "
                            f"set it to {math.ceil(peak / GB)} or more")
        fp = Footprint(device=m, learner_peak=peak, learner_resident=state, engine_weights=em.weights,
                       kv_per_token=em.kv_per_token, reserve=reserve_gb * GB)
        layout = "colocated, " + ("time-shared (the engine sleeps through the update)" if mp.sleep_engine
                                  else "resident (both stay on the device)")
        try:
            b = mp.decide_footprint(fp, environ={k: v for k, v in environ.items() if k.startswith("XLA_PYTHON")},
                                    device_source=f"--gpu ({device_gb:.1f} GB)")
            lines.append(f"layout   {layout}: " + b.line().removeprefix("[memory] "))
            headroom = (m - peak - asleep_gb * GB - reserve_gb * GB) if mp.sleep_engine else (
                b.learner_fraction * m - peak)
            data.update(layout=layout, engine_fraction=b.engine_fraction, learner_fraction=b.learner_fraction,
                        kv_tokens=b.kv_tokens, learner_headroom_gb=headroom / GB)
            if fits:
                why = (f"learner headroom {headroom / GB:.1f} GB; engine gpu_memory_utilization {b.engine_fraction:.2f}, "
                       f"KV cache {b.kv_tokens} tokens = {min(batch_seqs, b.kv_tokens // max_len)} of the batch's {batch_seqs} "
                       f"sequences at {max_len} tokens at once")
        except MemoryPlanError as e:
            lines.append(f"layout   {layout}")
            fits, why = False, str(e).removeprefix("memory plan: ")
    else:   # no memory plan: XLA preallocates on every GPU, the engine asks its share of GPU 0..t-1
        xla = float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", XLA_DEFAULT_FRACTION))
        if str(environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true")).lower() in ("false", "0"):
            xla = peak / m   # no pool: the learner holds what it uses, at most its peak
        if engine.name == "sglang":
            fits, why, layout, kv_room = _sglang_resident(xla=xla, share=engine.memory_fraction, m=m, peak=peak,
                                                          em=em, max_len=max_len, overhead=overhead_gb * GB,
                                                          reserve=reserve_gb * GB)
        else:
            share = engine.memory_fraction if engine.memory_fraction is not None else VLLM_DEFAULT_UTILIZATION
            layout = (f"no memory plan: XLA holds {xla:.2f} of each of the {learner_devices} learner GPU(s), vLLM "
                      f"asks gpu_memory_utilization {share:.2f} of GPU 0..{em.tensor_parallel - 1}")
            engine_need = em.weights + overhead_gb * GB + max_len * em.kv_per_token
            kv_room = share * m - em.weights - overhead_gb * GB
            if peak > xla * m:
                fits, why = False, f"learner peak {peak / GB:.1f} GB > XLA's share {xla:.2f} x {device_gb:.1f} GB"
            elif xla + share + reserve_gb * GB / m > 1:
                fits, why = False, (f"XLA's {xla:.2f} + vLLM's {share:.2f} + reserve {reserve_gb:.1f} GB exceed GPU 0: "
                                    "vLLM cannot start beside the learner")
            elif engine_need > share * m:
                fits, why = False, f"engine needs {engine_need / GB:.1f} GB > its share {share:.2f} x {device_gb:.1f} GB"
        lines.append(f"layout   {layout}")
        data.update(layout=layout, learner_fraction=xla)
        if fits:
            kv_tokens = int(kv_room / em.kv_per_token)
            why = (f"learner headroom {(xla * m - peak) / GB:.1f} GB; engine KV cache {kv_tokens} tokens = "
                   f"{min(batch_seqs, kv_tokens // max_len)} of the batch's {batch_seqs} sequences at {max_len} "
                   "tokens at once")
            data.update(kv_tokens=kv_tokens, learner_headroom_gb=(xla * m - peak) / GB)
        elif engine.name == "vllm":
            suggestions.append("compose --gin_file=gin/colocate.gin (one memory plan: the engine sleeps through the "
                               "update, XLA without preallocation)")
        else:
            f_l = math.ceil((peak + reserve_gb * GB / 2) / m * 100) / 100
            free = (1 - f_l) * m - reserve_gb * GB
            s_max = math.floor((1 - overhead_gb * GB / free) * 100) / 100
            suggestions.append(f"export XLA_PYTHON_CLIENT_MEM_FRACTION={f_l:.2f} and set mem_fraction_static={s_max:.2f} "
                               f"in ENGINE_KWARGS (KV cache {s_max:.2f} x {free / GB:.1f} GB free - weights)")
    if not fits:
        then = "" if memory_plan is not None or engine.name != "vllm" else "with gin/colocate.gin: "
        suggestions += [then + s for s in _suggest(peak=peak, state=state, grads=grads, learner_devices=learner_devices, m=m, em=em,
                                hf=hf, engine=engine, gpus=gpus, overhead=overhead_gb * GB, asleep=asleep_gb * GB,
                                reserve=reserve_gb * GB, max_len=max_len, memory=memory, colocated=memory_plan, mesh=mesh)]
    lines.append(("verdict  FITS: " if fits else "verdict  DOES NOT FIT: ") + why)
    for s in suggestions:
        lines.append(f"         change: {s}")
    for w in warnings:
        lines.append(f"warning  {w}")
    data.update(fits=fits, why=why, suggestions=suggestions, warnings=warnings)
    return Plan(lines, fits, data)


def _sglang_resident(*, xla, share, m, peak, em, max_len, overhead, reserve):
    """SGLang beside a preallocated learner. SGLang takes the GPU's free memory F when it starts (after the
    learner's pool and runtime) and sizes its KV cache after loading the weights as
    rest = free - F · (1 - mem_fraction_static) (sglang model_runner_kv_cache_mixin.py profile_max_num_token):

        F = (1 - f_L) · M - reserve,   KV cache = s · F - weights >= one MAX_MODEL_LEN sequence,
        (1 - s) · F >= SGLang's activations and CUDA graphs (the overhead)
    """
    layout = (f"no memory plan: XLA holds {xla:.2f} of each learner GPU; SGLang on GPU 0..{em.tensor_parallel - 1} "
              f"takes mem_fraction_static {share} of the memory then free")
    if share is None:
        return False, "SGLang's mem_fraction_static is unset (SGLang picks one per GPU); set it in ENGINE_KWARGS", \
            layout, 0.0
    free = (1 - xla) * m - reserve
    kv_room = share * free - em.weights
    if peak > xla * m:
        return False, f"learner peak {peak / GB:.1f} GB > XLA's share {xla:.2f} x {m / GB:.1f} GB", layout, kv_room
    if kv_room < max_len * em.kv_per_token:
        return False, (f"SGLang's KV cache {share:.2f} x {free / GB:.1f} GB free - weights {em.weights / GB:.1f} GB = "
                       f"{kv_room / GB:.1f} GB cannot hold one {max_len}-token sequence"), layout, kv_room
    if (1 - share) * free < overhead:
        return False, (f"mem_fraction_static {share:.2f} leaves {(1 - share) * free / GB:.1f} GB of the {free / GB:.1f} GB "
                       f"free for SGLang's activations, < {overhead / GB:.1f} GB"), layout, kv_room
    return True, "", layout, kv_room


def _suggest(*, peak, state, grads, learner_devices, m, em, hf, engine, gpus, overhead, asleep, reserve, max_len,
             memory, colocated, mesh) -> list[str]:
    """The smallest changes that make a time-shared colocated run fit, from the planned sizes: the learner's
    state and accumulator divide by its devices, its activations do not (they follow the micro-batch tokens)."""
    out = []
    temp = peak - state - grads
    total_state, total_grads = state * learner_devices, grads * learner_devices

    def fits_on(n, tp):
        e = engine_memory(hf, engine.quantization, tp)
        learner_phase = (total_state + total_grads) / n + temp + asleep + reserve
        engine_phase = total_state / n + reserve + e.weights + overhead + max_len * e.kv_per_token
        return learner_phase <= m and engine_phase <= m

    if colocated is not None and not colocated.sleep_engine and fits_on(gpus, em.tensor_parallel):
        out.append("SLEEP_ENGINE=True (time-shared)")
    for tp in (2, 4, 8):
        if em.tensor_parallel < tp <= gpus and fits_on(gpus, tp):
            out.append(f"the engine's tensor_parallel_size={tp} (ENGINE_KWARGS)")
            break
    if temp > m / 4 and mesh[3] == 1:  # activations dominate: fsdp does not split them
        out.append("a tensor axis in the learner's mesh (--gin.MESH_TENSOR=8: each layer's gathered weights and "
                   "activations split 8 ways; re-plan)")
    if memory.remat != "full":
        out.append("learner_jax.MemoryConfig.remat='full' (the largest single saving; re-plan)")
    if memory.max_tokens_per_micro_batch and memory.max_tokens_per_micro_batch // 2 >= max_len:
        out.append(f"learner_jax.MemoryConfig.max_tokens_per_micro_batch={memory.max_tokens_per_micro_batch // 2} "
                   "(activations ~halve; re-plan)")
    for n in sorted({gpus * k for k in (2, 3, 4, 6, 8, 12, 16)} | {16, 24, 32, 48, 64, 96, 128}):
        if n > gpus and fits_on(n, min(8, max(em.tensor_parallel, 1))):
            out.append(f"{n} GPUs with the learner's mesh over all of them (time-shared, engine tensor_parallel "
                       f"{min(8, max(em.tensor_parallel, 1))}; activations kept, state / {n})")
            break
    if not out:
        out.append("nothing in reach: the learner's activations alone exceed the device; shorten MAX_MODEL_LEN or "
                   "use a larger GPU")
    return out


# ------------------------------------------------------------------------------------------- CLI
def parse_args(argv):
    p = gin_utils.make_parser(__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run (the learner's mesh spans them)")
    p.add_argument("--gpu", default=None, help="the GPU model: " + ", ".join(__import__(
        "portable_rl.planning.gpus", fromlist=["x"]).GPU_MEMORY_GB))
    p.add_argument("--device_memory_gb", type=float, default=None, help="instead of --gpu: memory of one device")
    p.add_argument("--model_config", default=None, help="a config.json path or a shipped name; default MODEL_PATH's")
    p.add_argument("--full_compile", action="store_true", help="compile every layer (slow) instead of 1 and 2")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return p.parse_args(gin_utils.rewrite_gin_args(argv))


def run_plan(argv, environ: Mapping[str, str] = os.environ) -> Plan:
    """Parses the flags and the gin files, and plans (module doc)."""
    from portable_rl.train import register_gin

    args = parse_args(argv)
    if args.gpus < 1:
        raise ConfigError(f"--gpus={args.gpus}: give the number of GPUs of the run (>= 1)")
    if args.device_memory_gb is None and args.gpu is None:
        raise ConfigError("give --gpu (e.g. --gpu h100) or --device_memory_gb")
    device_gb = args.device_memory_gb if args.device_memory_gb is not None else gpu_memory_gb(args.gpu)
    register_gin()  # train's bindings parse as they do for a run
    try:
        gin_utils.parse_gin(args.gin_file, args.gin_bindings, args.gin_search_paths)
    except (ValueError, TypeError, KeyError) as e:
        gin_utils.exit_gin_error(e)  # one line naming the binding
    objects = gin_utils.CONFIG_OBJECTS
    hf, source = load_model_config(args.model_config, gin_utils.bound("rl.RunConfig.model_path", gin_utils.bound("MODEL_PATH")))
    import gin

    try:
        mesh_ref = gin.query_parameter("train.mesh")
        mesh_cfg = mesh_ref.scoped_configurable_fn() if hasattr(mesh_ref, "scoped_configurable_fn") else mesh_ref
    except ValueError:
        mesh_cfg = None
    result = plan(hf=hf, model_source=source, gpus=args.gpus, device_gb=device_gb, precision=objects["precision"](),
                  memory=objects["memory"](), mesh_cfg=mesh_cfg, dapo=objects["dapo"](),
                  engine=gin_utils.engine_settings(), memory_plan=gin_utils.run_memory_plan(learner_devices=args.gpus),
                  environ=environ, full_compile=args.full_compile,
                  moment1_dtype=gin_utils.bound("learner_jax.make_optimizer.moment1_dtype"))
    traps = gin_utils.gin_traps(args.gin_file, args.gin_bindings, args.gin_search_paths)
    result.data["warnings"] += traps
    result.lines += [f"warning  {w}" for w in traps]
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        result = run_plan(argv)
    except (UserError, FileNotFoundError) as e:
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None
    print(json.dumps(result.data) if "--json" in argv else "\n".join(result.lines), flush=True)
    sys.exit(0 if result.fits else 2)


if __name__ == "__main__":
    main()
