"""What a push must look like, read from the checkpoint an engine was started on (headers only, no torch).

An engine loads pushed `(hf_name, tensor)` pairs with its own weight loaders. A wrong name or shape there
either raises deep inside the engine (vLLM) or kills the engine's process tree, the trainer included
(SGLang 0.5.23: docs/engines.md). So adapters check every push against the checkpoint first:

    expected = {hf_name: shape} from the safetensors headers          (read_checkpoint_shapes)
    push ok  ⇔  names(push) ∪ optional ⊇ expected, names(push) ⊆ expected ∪ optional,
               no duplicates, shape(push[n]) = expected[n] for every n in expected

and raise `WeightUpdateError` (nothing loaded) otherwise.
"""

from __future__ import annotations

import json
import os
import struct

from portable_rl.errors import UserError


class WeightUpdateError(UserError, ValueError):
    """Pushed weights do not fit the engine's model; nothing was loaded."""


def safetensors_files(model_path: str) -> list[str]:
    """Sorted paths of the *.safetensors files in `model_path`; FileNotFoundError when there are none."""
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    return [os.path.join(model_path, f) for f in files]


def read_checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """{hf_name: shape} from the safetensors headers in `model_path` (reads only the headers)."""
    shapes = {}
    for path in safetensors_files(model_path):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))  # safetensors: u64 header size, then JSON
            header = json.loads(f.read(header_len))
        for key, info in header.items():
            if key != "__metadata__":
                shapes[key] = tuple(info["shape"])
    return shapes


def tied_embeddings(model_path: str) -> bool:
    with open(os.path.join(model_path, "config.json")) as f:
        return bool(json.load(f).get("tie_word_embeddings", False))


def check_named_tensors(pairs: list, expected: dict[str, tuple[int, ...]], optional: set[str]) -> None:
    """Raises WeightUpdateError unless `pairs` covers `expected` exactly with matching shapes."""
    names = [name for name, _ in pairs]
    duplicates = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
    unknown = sorted(set(names) - set(expected) - optional)
    missing = sorted(set(expected) - set(names))
    wrong_shape = [f"{n}: pushed {tuple(t.shape)}, engine has {expected[n]}"
                   for n, t in pairs if n in expected and tuple(t.shape) != expected[n]]
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} unknown names (first: {unknown[:3]})")
    if missing:
        problems.append(f"{len(missing)} missing names (first: {missing[:3]})")
    if wrong_shape:
        problems.append(f"{len(wrong_shape)} shape mismatches (first: {wrong_shape[:3]})")
    if duplicates:
        problems.append(f"duplicate names {duplicates[:3]}")
    if problems:
        raise WeightUpdateError(
            "weight update rejected, engine left unchanged: " + "; ".join(problems)
            + ". Push every HF-named tensor of the model (check convert/mapping.py for this family).")
