"""Trainer-side FP8 and INT8 quantizers and quantized start checkpoints (torch only; no JAX here).

128×128 blockwise FP8 (the DeepSeek-V3 / Qwen3-FP8 checkpoint format that SGLang and vLLM load as
`quant_method="fp8"` with `weight_block_size=[128, 128]`): for a linear weight W [out, in], every 128×128 tile
b gets one scale

    s_b = max|W_b| / 448                  (448 = largest finite float8_e4m3fn)
    Q_b = round_to_e4m3(W_b / s_b)        (float8_e4m3fn)
    W_b ≈ Q_b * s_b                       (dequantization; s is stored as `weight_scale_inv`, [ceil(out/128), ceil(in/128)] f32)

The name `weight_scale_inv` is the checkpoint convention: it multiplies Q back to W (it is the inverse of
the quantization scale 448 / amax). Only the decoder's projection matrices are quantized; embeddings,
norms, biases and lm_head stay in bf16, as in published FP8 checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Iterable, Iterator

import torch

from portable_rl.errors import UserError

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)
# The dense decoder projections (`Linear` modules in the learner).
QUANTIZED_PROJECTIONS = re.compile(
    r"\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")
# MoE experts (Qwen3-MoE / Qwen2-MoE per-expert HF names, and Qwen2-MoE's shared expert): an 8-bit engine serves
# them quantized like the dense projections; the routers (`mlp.gate`, `mlp.shared_expert_gate`) stay unquantized
# (an 8-bit router would move tokens to other experts; `int8_quantization_config`).
QUANTIZED_EXPERTS = re.compile(r"\.layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj\.weight$")


def quantize_blockwise_fp8(weight: torch.Tensor, block: tuple[int, int] = BLOCK
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """W [M, N] → (Q [M, N] float8_e4m3fn, scale_inv [ceil(M/bm), ceil(N/bn)] float32) with W ≈ Q * scale_inv."""
    if weight.dim() != 2:
        raise ValueError(f"blockwise FP8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    m, n = weight.shape
    bm, bn = block
    gm, gn = -(-m // bm), -(-n // bn)
    w = torch.zeros(gm * bm, gn * bn, dtype=torch.float32, device=weight.device)  # zero-pad to whole tiles
    w[:m, :n] = weight.to(torch.float32)
    tiles = w.view(gm, bm, gn, bn)  # [gm, bm, gn, bn]
    amax = tiles.abs().amax(dim=(1, 3))  # [gm, gn]
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)  # an all-zero tile keeps a tiny positive scale
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gm * bm, gn * bn)[:m, :n].contiguous(), scale_inv


def dequantize_blockwise_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_blockwise_fp8` (up to FP8 rounding)."""
    m, n = q.shape
    scale = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:m, :n]
    return (q.to(torch.float32) * scale).to(dtype)


def is_quantized_projection(name: str) -> bool:
    """A dense decoder projection (q/k/v/o, gate/up/down of a dense MLP)."""
    return QUANTIZED_PROJECTIONS.search(name) is not None


def is_quantized_weight(name: str) -> bool:
    """A weight 8-bit schemes serve quantized: the dense decoder projections and the MoE experts (never a
    router, an embedding, lm_head, a norm or a bias)."""
    return is_quantized_projection(name) or QUANTIZED_EXPERTS.search(name) is not None


def quantize_named_tensors_blockwise(pairs: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] = BLOCK
                                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs → projections as (name, fp8) + (name_scale_inv, f32); the rest unchanged."""
    for name, tensor in pairs:
        if is_quantized_projection(name):
            q, scale_inv = quantize_blockwise_fp8(tensor, block)
            yield name, q
            yield name + "_scale_inv", scale_inv  # "...proj.weight" → "...proj.weight_scale_inv"
        else:
            yield name, tensor


def blockwise_quantization_config(block: tuple[int, int] = BLOCK) -> dict:
    """The `quantization_config` entry of config.json for a blockwise FP8 checkpoint."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block)}


# ------------------------------------------------------------------------------------------------------
# INT8 W8A8, per output channel (`int8_per_channel`; the format FlashRL serves, compressed-tensors on disk):
#
#   s_c = max_i |W_ci| / 127          (s_c = 1 for an all-zero channel)
#   Q_ci = clamp(round(W_ci / s_c), −127, 127)    int8, round half to even (torch.round, jnp.round)
#   W_ci ≈ Q_ci · s_c                 (stored as `weight` int8 [out, in] and `weight_scale` f32 [out, 1])
#
# Activations are quantized by the engine per token at run time (dynamic, symmetric). The learner side
# (`learner_jax.quantize.quantize_int8_per_channel`) computes the same Q and s bit for bit in JAX.
# ------------------------------------------------------------------------------------------------------
INT8_MAX = 127.0
INT8_SCALE_SUFFIX = "weight_scale"  # "...proj.weight" -> "...proj.weight_scale"


class NonFiniteWeightError(UserError, ValueError):
    """A pushed weight holds NaN or inf: quantizing it would serve garbage; nothing is loaded."""


def int8_scale_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + INT8_SCALE_SUFFIX


def quantize_int8_per_channel(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] → (Q [out, in] int8, s [out, 1] float32) with W ≈ Q · s (formula above)."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: INT8 per-channel quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)  # [out, 1]; NaN anywhere in a row makes it NaN
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteWeightError(f"{name} holds NaN or inf (the learner diverged?); lower the learning rate or "
                                   "resume from an earlier checkpoint; nothing was loaded")
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_named_tensors_int8(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs → float projections and experts as (name, int8) + (name_scale, f32 [out, 1]); the
    rest, and weights already int8 (quantized by the learner), unchanged."""
    for name, tensor in pairs:
        if is_quantized_weight(name) and tensor.is_floating_point():
            q, scale = quantize_int8_per_channel(tensor, name)
            yield name, q
            yield int8_scale_name(name), scale
        else:
            yield name, tensor


def int8_quantization_config() -> dict:
    """config.json's `quantization_config` for INT8 W8A8: compressed-tensors, per-channel int8 weights,
    dynamic per-token int8 activations; vLLM loads it as `CompressedTensorsW8A8Int8`."""
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False},
                "input_activations": {**int8, "strategy": "token", "dynamic": True},
                "output_activations": None}},
            # MoE routers stay unquantized: an int8 router would move tokens to other experts
            "ignore": ["lm_head", "re:.*\\.mlp\\.gate$", "re:.*\\.mlp\\.shared_expert_gate$"],
            "kv_cache_scheme": None}


def is_int8_checkpoint(path: str) -> bool:
    """True when config.json of `path` declares the INT8 W8A8 format `int8_quantization_config` writes."""
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    return qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "int-quantized"


# ------------------------------------------------------------------------------------------------------
# Quantized copies of a bf16 checkpoint, written once next to the run.
# ------------------------------------------------------------------------------------------------------
def write_quantized_checkpoint(src: str, dst: str, quantize_pairs, quantization_config: dict) -> str:
    """Copies the HF checkpoint `src` to `dst`, each safetensors file's pairs through `quantize_pairs`, with
    `quantization_config` in config.json and the shard index rebuilt from what was written."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    weight_map = {}
    for fname in sorted(os.listdir(src)):
        path = os.path.join(src, fname)
        if fname.endswith(".safetensors"):
            tensors = {n: t.contiguous() for n, t in quantize_pairs(load_file(path).items())}
            save_file(tensors, os.path.join(dst, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, fname))
        elif fname == "config.json":
            with open(path) as f:
                config = json.load(f)
            config["quantization_config"] = quantization_config
            with open(os.path.join(dst, fname), "w") as f:
                json.dump(config, f, indent=2)
        elif os.path.isfile(path) and fname != "model.safetensors.index.json":
            shutil.copy(path, os.path.join(dst, fname))
    if os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        with open(os.path.join(src, "model.safetensors.index.json")) as f:
            index = json.load(f)
        index["weight_map"] = dict(sorted(weight_map.items()))
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return dst


def write_blockwise_fp8_checkpoint(src: str, dst: str, block: tuple[int, int] = BLOCK) -> str:
    """Copies the HF checkpoint `src` to `dst` with its projections quantized 128×128 (FP8 + weight_scale_inv)."""
    return write_quantized_checkpoint(src, dst, lambda pairs: quantize_named_tensors_blockwise(pairs, block),
                                      blockwise_quantization_config(block))


def write_int8_checkpoint(src: str, dst: str) -> str:
    """Copies the HF checkpoint `src` to `dst` with its projections INT8 per channel (int8 + weight_scale)."""
    return write_quantized_checkpoint(src, dst, quantize_named_tensors_int8, int8_quantization_config())


def is_blockwise_fp8_checkpoint(path: str, block: tuple[int, int] = BLOCK) -> bool:
    """True when config.json of `path` declares FP8 weights quantized in `block` tiles."""
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    return qc.get("quant_method") == "fp8" and qc.get("weight_block_size") == list(block)


SOURCE_MARKER = "portable_rl_quantized_source.json"  # written last, inside the checkpoint: it is complete


def _source_fingerprint(src: str, scheme: dict) -> dict:
    """What identifies the bf16 source cheaply: its real path, every file's name, size and mtime, the scheme."""
    src = os.path.realpath(src)
    files = [(f, st.st_size, st.st_mtime_ns) for f in sorted(os.listdir(src))
             if os.path.isfile(os.path.join(src, f)) for st in [os.stat(os.path.join(src, f))]]
    return {"source": src, "files": files, **scheme}


def _ensure_quantized_checkpoint(src: str, root: str, prefix: str, scheme: dict, write) -> str:
    """`write(src, tmp)`'s quantized copy of `src` in `root/<prefix>_<hash of the source fingerprint>`, written
    once: a later call with the same source (a resumed run, another engine of a fleet) finds it and returns
    at once. It is written into a temporary directory next to it and renamed into place, so a crash never
    leaves a half-written copy behind a valid name, and of two writers racing, one rename wins and the
    other's copy is dropped."""
    fingerprint = _source_fingerprint(src, scheme)
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
    dst = os.path.join(root, f"{prefix}_{key}")
    if os.path.exists(os.path.join(dst, SOURCE_MARKER)):
        return dst
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{prefix}_{key}.tmp-", dir=root)
    try:
        write(src, tmp)
        with open(os.path.join(tmp, SOURCE_MARKER), "w") as f:
            json.dump(fingerprint, f, indent=1)
        try:
            os.rename(tmp, dst)  # atomic; fails if dst exists (another writer finished first)
        except OSError:
            if not os.path.exists(os.path.join(dst, SOURCE_MARKER)):
                raise FileExistsError(f"{dst} exists but is not a complete quantized copy (no {SOURCE_MARKER}); "
                                      "delete it and start again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename
    return dst


def ensure_blockwise_fp8_checkpoint(src: str, root: str, block: tuple[int, int] = BLOCK) -> str:
    """The blockwise FP8 copy of the bf16 checkpoint `src` under `root`, written once, atomically."""
    return _ensure_quantized_checkpoint(src, root, "fp8_blockwise", {"weight_block_size": list(block)},
                                        lambda s, d: write_blockwise_fp8_checkpoint(s, d, block))


def ensure_int8_checkpoint(src: str, root: str) -> str:
    """The INT8 W8A8 per-channel copy of the bf16 checkpoint `src` under `root`, written once, atomically."""
    return _ensure_quantized_checkpoint(src, root, "int8_per_channel", {"scheme": "int8_per_channel"},
                                        lambda s, d: write_int8_checkpoint(s, d))


# ------------------------------------------------------------------------------------------------------
# Fake quantization (quantize → dequantize, same dtype out): what an engine serving a quantized copy of
# the weights computes with, expressed as plain tensors. Used by `engines.fake_quant` to emulate rollout
# schemes the CPU engine cannot run natively. Weight-only: activations stay in the engine's dtype.
#
#   "fp8_e4m3_tensor"  one scale per tensor:   s = max|W| / 448,  W' = e4m3(W / s) · s
#   "mxfp4"            OCP MX FP4: groups of 32 along the input dim, one power-of-two (E8M0) scale each,
#                      X = 2^(floor(log2 max|W_g|) − 2),  W' = e2m1(W / X) · X   (|e2m1| ≤ 6, clamped)
#   "nvfp4"            groups of 16 along the input dim, an e4m3 scale each under one fp32 tensor scale:
#                      g = max|W| / (448·6),  s_b = e4m3(max|W_b| / (6g)),  W' = e2m1(W / (s_b g)) · s_b g
# e2m1 (FP4) values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (and negatives); rounding is to nearest, ties to even.
# ------------------------------------------------------------------------------------------------------
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
FAKE_QUANT_SCHEMES = ("fp8_e4m3_tensor", "mxfp4", "nvfp4")


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Rounds float32 `x` to the nearest FP4 (e2m1) value, ties to even, saturating at ±6."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=x.device)
    mid = (grid[1:] + grid[:-1]) / 2                                   # 7 rounding boundaries
    a = x.abs().clamp(max=E2M1_MAX)
    down = torch.bucketize(a, mid, right=False)                        # a on a boundary → lower neighbour
    up = torch.bucketize(a, mid, right=True)                           # a on a boundary → upper neighbour
    idx = torch.where(down % 2 == 0, down, up)                         # ties: the even grid index (even mantissa)
    return torch.sign(x) * grid[idx]


def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    """W [..., N] float32 → [..., N / group, group] (N must be a multiple of group)."""
    n = weight.shape[-1]
    if n % group:
        raise ValueError(f"group size {group} must divide the input dim {n} (shape {tuple(weight.shape)})")
    return weight.reshape(*weight.shape[:-1], n // group, group)


def fake_quantize_mxfp4(weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    w = _grouped(weight.to(torch.float32), group)                      # [..., G, group]
    amax = w.abs().amax(dim=-1, keepdim=True)                          # [..., G, 1]
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2  # e2m1's largest exponent is 2
    scale = torch.exp2(exponent)
    return (round_to_e2m1(w / scale) * scale).reshape(weight.shape).to(weight.dtype)


def fake_quantize_nvfp4(weight: torch.Tensor, group: int = 16) -> torch.Tensor:
    w = _grouped(weight.to(torch.float32), group)                      # [..., G, group]
    tensor_scale = (w.abs().amax() / (FP8_MAX * E2M1_MAX)).clamp(min=1e-12)
    block_amax = w.abs().amax(dim=-1, keepdim=True)                    # [..., G, 1]
    block_scale = (block_amax / (E2M1_MAX * tensor_scale)).to(torch.float8_e4m3fn).to(torch.float32)
    scale = (block_scale * tensor_scale).clamp(min=1e-30)              # an all-zero block stays zero
    return (round_to_e2m1(w / scale) * scale).reshape(weight.shape).to(weight.dtype)


def fake_quantize_fp8_tensor(weight: torch.Tensor) -> torch.Tensor:
    w = weight.to(torch.float32)
    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
    return ((w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale).to(weight.dtype)


def fake_quantize(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """Quantize-dequantize a 2-D weight [out, in] with `scheme` (see FAKE_QUANT_SCHEMES); same shape and dtype."""
    if weight.dim() != 2:
        raise ValueError(f"fake quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    if scheme == "mxfp4":
        return fake_quantize_mxfp4(weight)
    if scheme == "nvfp4":
        return fake_quantize_nvfp4(weight)
    if scheme == "fp8_e4m3_tensor":
        return fake_quantize_fp8_tensor(weight)
    raise ValueError(f"unknown fake-quantization scheme {scheme!r}; use one of {FAKE_QUANT_SCHEMES}")


def fake_quantize_named_tensors(pairs: Iterable[tuple[str, torch.Tensor]], scheme: str
                                ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs → the decoder projections and experts fake-quantized with `scheme`; the rest
    unchanged."""
    for name, tensor in pairs:
        yield name, (fake_quantize(tensor, scheme) if is_quantized_weight(name) else tensor)
