"""Module boundaries from docs/architecture.md, checked on the source (no imports executed).

learner_jax/, tis/ and tasks/ never import torch, vLLM or SGLang; engines/ never imports JAX or Flax;
library code never imports gin (only the entry points train.py, evaluate.py, gin_utils.py do).
"""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "portable_rl"
TORCH_WORLD = {"torch", "vllm", "sglang", "transformers"}
JAX_WORLD = {"jax", "jaxlib", "flax", "optax", "orbax"}
GIN_ENTRY_POINTS = {"train.py", "evaluate.py", "gin_utils.py", "warmstart.py", "plan.py"}


def imported_top_level_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def package_files(subpackage: str) -> list[pathlib.Path]:
    return sorted((PKG / subpackage).rglob("*.py"))


@pytest.mark.parametrize("subpackage", ["learner_jax", "tis", "tasks"])
def test_jax_side_never_imports_torch_world(subpackage):
    files = package_files(subpackage)
    assert files, f"portable_rl/{subpackage} has no python files"
    offenders = {str(f.relative_to(PKG)): imported_top_level_modules(f) & TORCH_WORLD for f in files}
    assert not {k: v for k, v in offenders.items() if v}


def test_loop_reaches_torch_only_through_convert_and_engines():
    """rl/ orchestrates both worlds, but only through convert/ (tensors) and engines/ (adapters).

    transformers is allowed here for its tokenizers (rl/codec.py), which need no torch.
    """
    files = package_files("rl")
    assert files, "portable_rl/rl has no python files"
    offenders = {str(f.relative_to(PKG)): imported_top_level_modules(f) & (TORCH_WORLD - {"transformers"})
                 for f in files}
    assert not {k: v for k, v in offenders.items() if v}


def test_engines_never_import_jax_world():
    files = package_files("engines")
    assert files, "portable_rl/engines has no python files"
    offenders = {str(f.relative_to(PKG)): imported_top_level_modules(f) & JAX_WORLD for f in files}
    assert not {k: v for k, v in offenders.items() if v}


def test_library_code_is_gin_free():
    offenders = [str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
                 if f.name not in GIN_ENTRY_POINTS or f.parent != PKG
                 if "gin" in imported_top_level_modules(f)]
    assert not offenders, f"library modules import gin: {offenders}"


def test_engine_side_quantizer_does_not_pull_in_jax():
    """SGLang's blockwise-FP8 mode imports engines.quantize inside the engine process: no JAX there."""
    import subprocess
    import sys

    code = ("import sys; import portable_rl.engines.quantize, portable_rl.engines.buckets, portable_rl.engines; "
            "bad = [m for m in ('jax', 'flax', 'optax') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def _package_import_graph() -> dict[str, set[str]]:
    """portable_rl module → the portable_rl modules it imports anywhere in its source (function bodies too).

    `from pkg import sub` counts as importing the submodule `pkg.sub`, not the package's __init__.
    """
    def name(path: pathlib.Path) -> str:
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps.update(subs or {node.module})
        graph[module] = {d for d in deps if d in modules and d != module}
    return graph


def test_no_import_circles():
    """No two modules import each other, even lazily (issue 15: gin_utils ↔ warmstart was the one circle)."""
    graph = _package_import_graph()
    assert "portable_rl.gin_utils" in graph["portable_rl.warmstart"]   # the graph sees function-level imports

    def reaches(start, goal, seen):
        return any(d == goal or (d not in seen and not seen.add(d) and reaches(d, goal, seen)) for d in graph[start])

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert not circles, f"modules on an import circle: {circles}"


def test_rl_package_docstring_names_only_its_modules():
    """rl/__init__.py's module list names modules that exist (issue 15: it named a missing `scoring`)."""
    import re

    import portable_rl.rl as rl

    named = re.findall(r"^- `(\w+)`", rl.__doc__, re.M)
    assert len(named) > 5
    missing = [n for n in named if not (PKG / "rl" / f"{n}.py").is_file()]
    assert not missing, f"rl/__init__.py names missing modules: {missing}"


def test_importing_the_package_writes_no_environment_and_patches_nothing():
    """Environment writes and vLLM patches happen where an entry point or engine starts, never on import:
    every portable_rl module is imported (JAX first: it sets its own variables) and nothing changed."""
    import subprocess
    import sys

    code = ("import importlib, os, pkgutil, jax, portable_rl; before = dict(os.environ); "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(portable_rl.__path__, 'portable_rl.')]; "
            "changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}; "
            "assert not changed, changed; "
            "import sys; assert 'vllm' not in sys.modules, 'vLLM was imported (and could be patched) on import'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_entry_points_import_no_torch_before_their_cli_sets_openmp():
    """The CLIs set OMP_WAIT_POLICY before anything loads torch's OpenMP runtime (read once, at load): importing
    an entry point module must not import torch."""
    import subprocess
    import sys

    for module in ("portable_rl.train", "portable_rl.evaluate", "portable_rl.warmstart"):
        code = f"import sys, {module}; assert 'torch' not in sys.modules, '{module} imports torch at import'"
        subprocess.run([sys.executable, "-c", code], check=True)
