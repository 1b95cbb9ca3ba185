"""Engine registry: name → adapter factory.

In-tree adapters register with the decorator:

    @register("vllm")
    class VLLMEngine(EngineAdapter): ...

Out-of-tree packages register through the entry-point group `portable_rl.engines` in their pyproject:

    [project.entry-points."portable_rl.engines"]
    my_engine = "my_pkg.adapter:MyEngine"

`create_engine(name, **kwargs)` is the single factory (gin binds `name` and the kwargs in train.py).
Entry points are loaded lazily, the first time an unknown name is looked up or the list is asked for,
so importing this module never imports an engine.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Callable

from portable_rl.engines.base import EngineAdapter
from portable_rl.errors import UnknownNameError

ENTRY_POINT_GROUP = "portable_rl.engines"
_BUILTIN_MODULES = ("portable_rl.engines.vllm_adapter", "portable_rl.engines.sglang_adapter", "portable_rl.engines.ray_fleet",
                    "portable_rl.engines.fake_quant")

_REGISTRY: dict[str, Callable[..., EngineAdapter]] = {}
_builtins_loaded = False


class UnknownEngineError(UnknownNameError):
    """An engine name nobody registered."""


def register(name: str):
    """Class/function decorator registering an adapter factory under `name`."""
    if not name or not isinstance(name, str):
        raise ValueError(f"engine name must be a non-empty string, got {name!r}")

    def decorator(factory):
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not factory:
            raise ValueError(f"engine name {name!r} is already registered to {existing!r}; pick another name")
        _REGISTRY[name] = factory
        return factory

    return decorator


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:  # these import their engine lazily, so this is cheap
            importlib.import_module(module)


def _entry_points():
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _load_entry_point(ep) -> None:
    obj = ep.load()  # importing the module may itself call register(...)
    if ep.name not in _REGISTRY:
        if not callable(obj):
            raise TypeError(f"entry point {ep.name} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} "
                            "must name an EngineAdapter subclass or a factory function")
        _REGISTRY[ep.name] = obj


def available_engines() -> list[str]:
    """Sorted names of in-tree and installed out-of-tree engines."""
    _load_builtins()
    return sorted(set(_REGISTRY) | {ep.name for ep in _entry_points()})


def get_engine_factory(name: str) -> Callable[..., EngineAdapter]:
    _load_builtins()
    if name not in _REGISTRY:
        for ep in _entry_points():
            if ep.name == name:
                _load_entry_point(ep)
                break
    if name not in _REGISTRY:
        raise UnknownEngineError(
            f"unknown engine {name!r}; known engines: {', '.join(available_engines()) or '(none)'}. "
            f"Out-of-tree adapters register through the {ENTRY_POINT_GROUP!r} entry-point group "
            "(see docs/engines.md)")
    return _REGISTRY[name]


def create_engine(name: str, **kwargs) -> EngineAdapter:
    """Builds the engine registered as `name` with `kwargs` (passed straight to its constructor).

    Args:
      name: the registered engine: "vllm", "sglang", "ray_fleet", "fake_quant", or an out-of-tree adapter's
        entry-point name; its keywords are listed under `engines.create_engine (name = ...)`.
    """
    engine = get_engine_factory(name)(**kwargs)
    if not isinstance(engine, EngineAdapter):
        raise TypeError(f"engine {name!r} built a {type(engine).__name__}, not an EngineAdapter")
    if not hasattr(engine, "quantization"):
        engine.close()
        raise TypeError(f"engine {name!r} ({type(engine).__name__}) does not report `quantization`: set it in the "
                        "adapter, None for an engine serving the pushed weights as they are (engines/base.py)")
    return engine
