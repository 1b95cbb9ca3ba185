"""The parts of SGLang's API the adapter relies on, read from SGLang's source with `ast` (never imported).

    python tests/sglang_api.py /path/to/sglang-0.5.23-*.whl    # or a directory holding sglang/ (or site-packages)

rewrites `tests/fixtures/sglang_api_<version>.json`, the recorded table that `tests/sglang_fake.py` takes its
keyword sets from. `tests/test_engines_sglang.py` re-reads the source whenever one is available (an
installed sglang, or $SGLANG_SRC naming a wheel or a directory) and fails if it differs from the table.

What is recorded (0.5.23 layout):
  server_args       every field of `ServerArgs`: the annotated fields of the namespace classes listed in
                    `_INPUT_NAMESPACES` (srt/server_args.py), declared in srt/arg_groups/fields/*.py
  engine            for each `Engine` method the adapter calls, its parameters as [name, default source]
                    (default None-string when required) in order (srt/entrypoints/engine.py)
  engine_coroutines those of them defined `async def` (async_generate: awaited on Engine.loop)
  sampling_params   the fields of `SamplingParams` (srt/sampling/sampling_params.py)
  memory_tags       GPU_MEMORY_ALL_TYPES (srt/constants.py): what release_memory_occupation() frees by default
  outside_session   the reply text of update_weights_from_tensor outside a session
                    (srt/managers/scheduler_components/weight_updater.py)
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

from portable_rl.engines.canary import PackageSource
from portable_rl.engines.sglang_internals import server_args_fields

ENGINE_METHODS = ("__init__", "generate", "async_generate", "begin_weight_update", "end_weight_update",
                  "update_weights_from_tensor", "flush_cache", "release_memory_occupation", "resume_memory_occupation",
                  "shutdown")
FIXTURES = Path(__file__).parent / "fixtures"


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise KeyError(name)


def _fields(cls: ast.ClassDef) -> list[str]:
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def _parameters(fn: ast.FunctionDef) -> list[list]:
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [[a.arg, None if d is None else ast.unparse(d)] for a, d in zip(positional, defaults)]
    if args.vararg:
        out.append(["*" + args.vararg.arg, None])
    out += [[a.arg, None if d is None else ast.unparse(d)] for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append(["**" + args.kwarg.arg, None])
    return out


def read_api(where: str) -> dict:
    src = PackageSource("sglang", where)
    engine = _class(src.tree("sglang.srt.entrypoints.engine"), "Engine")
    methods = {n.name: n for n in engine.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    constants = src.tree("sglang.srt.constants")
    names = {n.targets[0].id: n.value for n in constants.body if isinstance(n, ast.Assign)}
    memory_tags = [ast.literal_eval(names[e.id]) for e in names["GPU_MEMORY_ALL_TYPES"].elts]
    outside = None
    for node in ast.walk(src.tree("sglang.srt.managers.scheduler_components.weight_updater")):
        if isinstance(node, ast.keyword) and node.arg == "message":
            try:
                text = ast.literal_eval(node.value)
            except ValueError:
                continue
            if text.startswith("update_weights_from_tensor must run between"):
                outside = text
    return {
        "version": src.version(),
        "server_args": sorted(server_args_fields(src)),
        "engine": {m: _parameters(methods[m]) for m in ENGINE_METHODS},
        "engine_coroutines": sorted(m for m in ENGINE_METHODS if isinstance(methods[m], ast.AsyncFunctionDef)),
        "sampling_params": sorted(_fields(_class(src.tree("sglang.srt.sampling.sampling_params"), "SamplingParams"))),
        "memory_tags": memory_tags,
        "outside_session": outside,
    }


def find_source() -> str | None:
    """$SGLANG_SRC (a wheel, or a directory holding sglang/), else an installed sglang's site dir, else None."""
    where = os.environ.get("SGLANG_SRC")
    if where:
        return where
    import importlib.util

    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is not None and spec.origin:
        return str(Path(spec.origin).parent.parent)
    return None


def fixture_path(version: str) -> Path:
    return FIXTURES / f"sglang_api_{version}.json"


def load_recorded(version: str = "0.5.23") -> dict:
    return json.loads(fixture_path(version).read_text())


if __name__ == "__main__":
    api = read_api(sys.argv[1] if len(sys.argv) > 1 else find_source())
    path = fixture_path(api["version"])
    path.write_text(json.dumps(api, indent=1) + "\n")
    print(f"wrote {path}: {len(api['server_args'])} ServerArgs fields, {len(api['engine'])} Engine methods")
