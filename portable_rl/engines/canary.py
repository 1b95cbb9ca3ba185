"""Canaries for an engine's private internals, read from its source (never imported, so a GPU wheel works too).

`engines/vllm_internals.py` and `engines/sglang_internals.py` list every private symbol, monkeypatch, log
message and teardown step of their engine that portable_rl relies on, each as an `Internal` whose `check`
reads the engine's source with `ast` and says what no longer holds. `check_internals` runs them all against
an installed package, an unpacked wheel or the wheel itself, and returns one `Problem` per broken internal;
its `str` is the one line to act on: engine version, symbol, what changed, our file to change.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from portable_rl.errors import ConfigError


def check_version(engine: str, version: str, supported: tuple[tuple[int, ...], tuple[int, ...]], fix: str) -> None:
    """Raises ConfigError, in one line ending with `fix`, unless `version`'s release numbers lie in
    `supported` = [lower, upper) (tuples compared as Python compares them: 0.5.23.post1 → (0, 5, 23) ≥ (0, 5, 23),
    0.33.0 → (0, 33, 0) ≥ (0, 33)). The adapters' internals change between releases, so only tested ones run."""
    (lo, hi), parts = supported, re.match(r"\d+(\.\d+)*", version)
    release = tuple(int(p) for p in parts[0].split(".")) if parts else None
    if release is None or not lo <= release < hi:
        dotted = ".".join(map(str, lo))
        tested = (f"{dotted}.x" if len(lo) == 2 else f"{dotted} or a later {lo[0]}.{lo[1]}.x") \
            if hi == (lo[0], lo[1] + 1) else f"{dotted} up to {'.'.join(map(str, hi))}"
        raise ConfigError(f"{engine} {version} is installed, but portable_rl's {engine} adapter is tested with "
                          f"{tested} only; {fix}")


class PackageSource:
    """The `.py` files of package `package`, from a wheel, a directory holding `<package>/`, or the installed
    package (where=None: located with importlib, not imported)."""

    def __init__(self, package: str, where: str | os.PathLike | None = None):
        self.package = package
        if where is None:
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.origin:
                raise ModuleNotFoundError(f"{package} is not installed; pass its wheel or unpacked source")
            where = Path(spec.origin).parent.parent
        self.where = str(where)
        self._zip = zipfile.ZipFile(self.where) if self.where.endswith(".whl") else None
        self._trees: dict[str, ast.Module | None] = {}

    def read(self, module: str) -> str | None:
        """The text of dotted `module` (a module file or a package's __init__), None if it has neither."""
        stem = module.replace(".", "/")
        for rel in (f"{stem}.py", f"{stem}/__init__.py"):
            try:
                if self._zip is not None:
                    return self._zip.read(rel).decode()
                return Path(self.where, rel).read_text()
            except (KeyError, FileNotFoundError, NotADirectoryError):
                continue
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.read(module)
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]

    def version(self) -> str:
        """`__version__` from `<package>/_version.py` (generated at build time by vLLM's and SGLang's builds)."""
        for node in (self.tree(f"{self.package}._version") or ast.Module(body=[])).body:
            if isinstance(node, ast.Assign) and "__version__" in {ast.unparse(t) for t in node.targets}:
                return ast.literal_eval(node.value)
        return "(unknown version)"

    def glob(self, pattern: str) -> list[str]:
        """Paths (relative, '/'-separated) of the files matching `pattern`, e.g. 'sglang/srt/models/*.py'."""
        if self._zip is not None:
            return sorted(n for n in self._zip.namelist() if fnmatch.fnmatch(n, pattern))
        return sorted(p.relative_to(self.where).as_posix() for p in Path(self.where).glob(pattern))


# ------------------------------------------------------------------------------------------- AST look-ups
def find_class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def find_function(scope: ast.Module | ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    for node in scope.body if scope is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def parameters(fn: ast.FunctionDef) -> list[str]:
    """Parameter names in order; keyword-only ones after a '*' entry, as in a signature."""
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        names.append("*")
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return names


def self_attributes_assigned(fn: ast.FunctionDef) -> set[str]:
    """The `self.<name>` attributes `fn` assigns."""
    return {t.attr for node in ast.walk(fn) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def string_constants(node: ast.AST | None) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)} \
        if node is not None else set()


def names_used(node: ast.AST | None) -> set[str]:
    """Every name mentioned in `node`: bare names, attribute names, imported names (calls, reads, writes)."""
    names = set()
    for n in ast.walk(node) if node is not None else ():
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.alias):
            names.add(n.asname or n.name)
    return names


def class_fields(cls: ast.ClassDef | None) -> set[str]:
    """Annotated class-level fields (a dataclass's or msgspec struct's fields)."""
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)} \
        if cls is not None else set()


def method_problem(src: PackageSource, module: str, cls: str, method: str,
                   params: list[str] | None = None) -> tuple[ast.FunctionDef | None, str | None]:
    """(the method's AST, None) if `module.cls.method` exists (with exactly `params`, when given), else
    (None or the method, what differs)."""
    tree = src.tree(module)
    if tree is None:
        return None, f"module {module} is gone"
    klass = find_class(tree, cls)
    if klass is None:
        return None, f"class {cls} is gone from {module}"
    fn = find_function(klass, method)
    if fn is None:
        return None, f"{cls}.{method} is gone"
    if params is not None and parameters(fn) != params:
        return fn, f"{cls}.{method} takes ({', '.join(parameters(fn))}), not ({', '.join(params)})"
    return fn, None


# ------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Internal:
    """One thing of the engine's that portable_rl relies on beyond its public API."""

    name: str
    symbol: str      # the engine's symbol, dotted
    relies_on: str   # what we assume about it, and why we need it
    used_by: str     # our file:function that breaks with it
    check: Callable[[PackageSource], str | None]  # what no longer holds in this source, None when all does


@dataclass(frozen=True)
class Problem:
    internal: Internal
    engine: str
    version: str
    what: str

    def __str__(self) -> str:
        return (f"{self.engine} {self.version}: {self.internal.symbol}: {self.what}; "
                f"update {self.internal.used_by} (internal '{self.internal.name}')")


def main(check, all_hold: str, argv: list[str]) -> int:
    """`python -m portable_rl.engines.<engine>_internals [wheel or dir]`: one line per broken internal (exit 1),
    or `all_hold` (exit 0)."""
    problems = check(argv[0] if argv else None)
    print("\n".join(map(str, problems)) or all_hold)
    return 1 if problems else 0


def check_internals(internals: tuple[Internal, ...], src: PackageSource, engine: str) -> list[Problem]:
    """One Problem per internal whose check fails against `src` (a check that raises counts as failed)."""
    version = src.version()
    problems = []
    for internal in internals:
        try:
            what = internal.check(src)
        except Exception as e:  # noqa: BLE001 (a layout the check did not expect is a broken internal too)
            what = f"unreadable ({type(e).__name__}: {e})"
        if what is not None:
            problems.append(Problem(internal, engine, version, what))
    return problems
