"""Hugging Face checkpoints <-> the Flax NNX `Transformer`.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Names follow `convert/mapping.py`; linear weights are transposed.
MoE experts: the E per-expert HF matrices of a stacked NNX array [E, in, out] are stacked on load and
sliced (`value[e]`) on export, so checkpoints and pushes use the hub's per-expert names.

`save_hf_model` writes config.json + safetensors into a temporary sibling directory and renames it
into place, so a crash never leaves a half-written checkpoint. Tokenizer files are not copied
(`copy_tokenizer_files` does that for callers that want it).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from portable_rl.convert.mapping import ParamMapping, param_mappings
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.model import Transformer
from portable_rl.learner_jax.quantize import quantize_int8_per_channel
from portable_rl.learner_jax.sharding import gather_for_export

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default shard size
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
# Tensors some checkpoints carry that the model recomputes; skipped on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_quantize_int8 = jax.jit(quantize_int8_per_channel)


@jax.jit
def _quantize_int8_rows(stack):
    """[E, in, out] → (Q [E, in, out] int8, s [E, out] f32, finite [E] bool): each expert on its own (the scales
    are per output channel of each expert; not a vmap, under which XLA rounds the divisions differently)."""
    q, scale, _ = quantize_int8_per_channel(stack)
    return q, scale, jnp.all(jnp.isfinite(stack.astype(jnp.float32)), axis=(-2, -1))


LEARNER_QUANTIZED = ("int8_per_channel",)  # engine schemes whose weights the learner quantizes before the push
_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def _dtype_name(dtype) -> str:
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {name!r}; use one of {sorted(_DTYPES)}")
    return name


def get_param(model: nnx.Module, path: tuple) -> nnx.Param:
    """The `nnx.Param` at `path` (attribute names and list indices)."""
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


@functools.partial(jax.jit, static_argnames=("dtype", "transpose"))
def _cast(x, dtype, transpose):
    """`x` cast to `dtype` and, if asked, transposed; one fused XLA op writing a row-major result."""
    x = x.astype(dtype)
    return x.T if transpose else x


# ---------------------------------------------------------------------------------------- load
def _tensor_files(path: Path) -> dict[str, Path]:
    """HF name -> safetensors file holding it."""
    if (path / SAFE_INDEX).exists():
        weight_map = json.loads((path / SAFE_INDEX).read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    from safetensors import safe_open

    from portable_rl.engines.checkpoint import safetensors_files  # the one listing rule (pure Python)

    try:
        files = [path / SAFE_SINGLE] if (path / SAFE_SINGLE).exists() else [Path(f) for f in safetensors_files(path)]
    except FileNotFoundError:
        raise FileNotFoundError(f"no *.safetensors in {path}; re-save the checkpoint with "
                                f"transformers' save_pretrained(..., safe_serialization=True)") from None
    out = {}
    for f in files:
        with safe_open(f, framework="flax") as st:
            out.update({name: f for name in st.keys()})
    return out


def load_hf_model(path: str | os.PathLike, *, param_dtype=None, compute_dtype=None,
                  attention_impl: str = "dense", remat="none",
                  moe_dispatch: str = "gspmd") -> tuple[Transformer, ModelConfig]:
    """Reads an HF checkpoint directory into a `Transformer` (params in `param_dtype`, default float32;
    compute in `compute_dtype`, default bfloat16; `attention_impl`, `remat` and `moe_dispatch` as in `Transformer`,
    e.g. `**MemoryConfig(...).model_kwargs()`)."""
    from safetensors import safe_open

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {path}; pass the directory of an HF checkpoint "
                                f"(config.json + *.safetensors)")
    config = ModelConfig.from_json_file(str(path / "config.json"))
    param_dtype = jnp.dtype(param_dtype or jnp.float32)
    compute_dtype = jnp.dtype(compute_dtype or jnp.bfloat16)
    # Build the module skeleton without initialising random weights, then fill every param.
    model = nnx.eval_shape(lambda: Transformer(config, param_dtype=param_dtype, compute_dtype=compute_dtype,
                                               rngs=nnx.Rngs(0), attention_impl=attention_impl,
                                               remat=remat, moe_dispatch=moe_dispatch))
    mappings = {m.hf_name: m for m in param_mappings(config)}
    files = _tensor_files(path)
    missing = sorted(set(mappings) - set(files))
    if missing:
        raise KeyError(f"{path} lacks tensor {missing[0]!r} ({len(missing)} missing); the safetensors "
                       f"do not match config.json (model_type={config.family}, "
                       f"tie_word_embeddings={config.tie_word_embeddings})")
    unexpected = sorted(n for n in set(files) - set(mappings)
                        if not n.endswith(_IGNORED_SUFFIXES)
                        and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if unexpected:
        raise KeyError(f"{path} has tensor {unexpected[0]!r} that config.json does not describe "
                       f"({len(unexpected)} unexpected); check model_type / num_hidden_layers in config.json")
    by_file: dict[Path, list[ParamMapping]] = {}
    for name, m in mappings.items():
        by_file.setdefault(files[name], []).append(m)
    expert_slices: dict[tuple, dict[int, jax.Array]] = {}  # stacked NNX path -> {expert: [in, out]}
    for fname, ms in by_file.items():
        with safe_open(fname, framework="flax") as st:
            for m in ms:
                param = get_param(model, m.nnx_path)
                value = st.get_tensor(m.hf_name)
                shape = param.shape if m.expert is None else param.shape[1:]
                hf_shape = tuple(reversed(shape)) if m.transpose else tuple(shape)
                if tuple(value.shape) != hf_shape:
                    raise ValueError(f"tensor {m.hf_name!r} has shape {tuple(value.shape)} in {fname.name} "
                                     f"but config.json implies {hf_shape}; fix config.json")
                if m.expert is None:
                    param.set_value(_cast(value, param_dtype, m.transpose))
                else:
                    expert_slices.setdefault(m.nnx_path, {})[m.expert] = _cast(value, param_dtype, m.transpose)
    for nnx_path, slices in expert_slices.items():  # every expert is there: `missing` above checked
        get_param(model, nnx_path).set_value(jnp.stack([slices[e] for e in range(len(slices))]))
    return model, config


# ---------------------------------------------------------------------------------------- export
def _mapped_values(model: Transformer, config: ModelConfig) -> Iterator[tuple[ParamMapping, jax.Array]]:
    """(mapping row, its value in the NNX layout), lazily; an expert row gets its slice of the stacked
    [E, ...] array."""
    for m in param_mappings(config):
        value = get_param(model, m.nnx_path)[...]
        yield m, (value if m.expert is None else value[m.expert])


def cast_params(model: Transformer, config: ModelConfig, dtype="bfloat16"
                ) -> Iterator[tuple[ParamMapping, jax.Array]]:
    """(mapping row, parameter cast to `dtype` in the NNX layout), lazily; no copy if already `dtype`."""
    dtype = _DTYPES[_dtype_name(dtype)]
    for m, value in _mapped_values(model, config):
        value = value if value.dtype == dtype else value.astype(dtype)
        # A sharded learner (learner_jax/sharding.py) holds multi-device arrays, which DLPack cannot
        # export: gather this one parameter (after the cast: fewer bytes). Single-device arrays are
        # returned unchanged, so the unsharded path stays zero-copy.
        yield m, gather_for_export(value)


def export_arrays(model: Transformer, config: ModelConfig, *, dtype="bfloat16", quantization: str | None = None,
                  smoothing=None) -> Iterator[tuple[str, jax.Array, bool]]:
    """What a push sends, lazily: (HF name, array in the NNX layout, transpose to the HF layout?).

    `quantization="int8_per_channel"`: each decoder projection and each MoE expert (`engines.quantize.
    is_quantized_weight`; routers stay float) is quantized here, on the learner's devices and before the gather
    (`learner_jax.quantize.quantize_int8_per_channel` of its `dtype` cast), and sent as int8 `weight` + f32
    `weight_scale` [out, 1], the engine's checkpoint format: half the bytes of bf16. A stacked expert array
    [E, in, out] is quantized once (per-channel scales never mix experts) and each expert's row gets its slice.
    A weight holding NaN or inf raises `NonFiniteWeightError` before it is yielded. `smoothing`
    (`convert.smoothing.Smoothing`, INT8 only) rescales norms and projections first. Every learner process
    runs this in the same order (the gathers are collectives, rl/sync.py)."""
    if quantization not in (None, *LEARNER_QUANTIZED):
        raise ValueError(f"quantization={quantization!r}: the learner quantizes only {LEARNER_QUANTIZED}")
    if smoothing is not None and quantization is None:
        raise ValueError("SmoothQuant smoothing only makes sense for a W8A8 push (quantization='int8_per_channel')")
    if quantization is not None:
        from portable_rl.engines.quantize import NonFiniteWeightError, int8_scale_name, is_quantized_weight
    dtype = _DTYPES[_dtype_name(dtype)]
    stacked = (None, None)  # (nnx path, its quantized stack): the experts of one array arrive consecutively
    for m in param_mappings(config):
        if quantization is None or not is_quantized_weight(m.hf_name):
            value = get_param(model, m.nnx_path)[...]
            value = value if m.expert is None else value[m.expert]
            if smoothing is not None:
                value = smoothing.apply(m.hf_name, value)
            value = value if value.dtype == dtype else value.astype(dtype)
            yield m.hf_name, gather_for_export(value), m.transpose
            continue
        if m.expert is None:
            value = get_param(model, m.nnx_path)[...]
            if smoothing is not None:
                value = smoothing.apply(m.hf_name, value)
            q, scale, finite = _quantize_int8(value if value.dtype == dtype else value.astype(dtype))
        else:  # an expert's row: its slice of the stack, quantized once for every expert
            if stacked[0] != m.nnx_path:
                value = get_param(model, m.nnx_path)[...]
                stacked = (m.nnx_path, _quantize_int8_rows(value if value.dtype == dtype else value.astype(dtype)))
            q, scale, finite = (x[m.expert] for x in stacked[1])
        if not bool(finite):  # q [in, out] int8, scale [out] f32
            raise NonFiniteWeightError(f"{m.hf_name} holds NaN or inf (the learner diverged?); lower the learning "
                                       "rate or resume from an earlier checkpoint; nothing was loaded")
        yield m.hf_name, gather_for_export(q), m.transpose
        yield int8_scale_name(m.hf_name), gather_for_export(scale[:, None]), False


def hf_arrays(model: Transformer, config: ModelConfig, dtype="bfloat16") -> Iterator[tuple[str, jax.Array]]:
    """(HF name, JAX array in HF layout and `dtype`), lazily, one parameter at a time.

    The single source of exported values: `save_hf_model` writes these; `to_torch` hands torch the same
    values from `cast_params`, with the HF-layout transpose done as a torch view.
    """
    for m, value in cast_params(model, config, dtype):
        yield m.hf_name, (value.T if m.transpose else value)


# ---------------------------------------------------------------------------------------- save
def _plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Groups consecutive tensors into shards of at most `max_shard_bytes` (one tensor may exceed it)."""
    shards, size = [[]], 0
    for name, nbytes in sizes:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_hf_model(model: Transformer, config: ModelConfig, path: str | os.PathLike, *, dtype=None,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False) -> str:
    """Writes config.json + safetensors (sharded with an index above `max_shard_bytes`) to `path`.

    `dtype` defaults to the checkpoint's own dtype from config.json, else bfloat16.
    Atomic: everything goes to a temporary sibling directory that is renamed to `path` at the end.
    """
    from safetensors.flax import save_file

    path = Path(path)
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite=True or choose a new directory")
    dtype = _dtype_name(dtype or config.torch_dtype or "bfloat16")
    hf_config = config.to_hf_dict()
    hf_config["dtype" if "dtype" in hf_config else "torch_dtype"] = dtype

    itemsize = jnp.dtype(_DTYPES[dtype]).itemsize
    def hf_size(m):  # an expert row is one [in, out] slice of its stacked array
        shape = get_param(model, m.nnx_path).shape
        return math.prod(shape if m.expert is None else shape[1:]) * itemsize

    sizes = [(m.hf_name, hf_size(m)) for m in param_mappings(config)]
    plan = _plan_shards(sizes, max_shard_bytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        arrays = hf_arrays(model, config, dtype)  # lazy: one shard's arrays alive at a time
        weight_map = {}
        for k, names in enumerate(plan):
            fname = SAFE_SINGLE if len(plan) == 1 else f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
            shard = dict(itertools.islice(arrays, len(names)))
            save_file(shard, tmp / fname, metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
            del shard
        if len(plan) > 1:
            index = {"metadata": {"total_size": sum(n for _, n in sizes)},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(path)


def replace_dir(tmp: Path, path: Path) -> None:
    """Renames `tmp` to `path`; an existing `path` is moved aside first and removed afterwards."""
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rename(path, old / "d")
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copies the tokenizer files present in `src` into `dst`; returns the names copied."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in {src}; expected one of {', '.join(TOKENIZER_FILES)}")
    return copied
