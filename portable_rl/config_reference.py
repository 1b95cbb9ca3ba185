"""Writes docs/reference/configuration.md: every gin-bindable knob, its default and its one-line meaning.

    python -m portable_rl.config_reference            # rewrite the file
    python -m portable_rl.config_reference --check    # exit 1 when it is stale (tests/test_config_reference.py)

The knobs are the parameters of what `gin_utils` registers (train and its config objects, tasks, optimizer,
warm start, memory plan, evaluate, ...) and the constructor keywords of every registered engine adapter
(`engines.create_engine.<keyword>`). A knob's meaning is its line in the owner's docstring, Google style:
an `Args:` section (functions) or an `Attributes:` section (config classes), `name: meaning`, continuation
lines indented further. A knob without one is an error here: the reference is complete or it is not written.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Callable

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md"
SECTION = re.compile(r"^(\s*)(Args|Attributes|Arguments):\s*$")


def documented_parameters(obj) -> dict[str, str]:
    """{name: meaning} from the `Args:` / `Attributes:` sections of `obj`'s docstring (continuations joined)."""
    doc = inspect.getdoc(obj) or ""
    out, current, indent = {}, None, None
    in_section = False
    for line in doc.splitlines():
        if SECTION.match(line):
            in_section, current, indent = True, None, None
            continue
        if not in_section:
            continue
        if not line.strip():
            current = None
            continue
        width = len(line) - len(line.lstrip())
        entry = re.match(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
        if entry and (indent is None or width == indent):
            indent = width
            current = entry.group(1)
            out[current] = entry.group(2).strip()
        elif current is not None and width > (indent or 0):
            out[current] = f"{out[current]} {line.strip()}"
        else:
            in_section = False
    return out


def parameters(obj) -> list[tuple[str, object]]:
    """(name, default or inspect.Parameter.empty) of what gin can bind on `obj`."""
    target = inspect.unwrap(obj)
    if dataclasses.is_dataclass(target):
        return [(f.name, f.default if f.default is not dataclasses.MISSING else
                 (f"{f.default_factory.__name__}()" if f.default_factory is not dataclasses.MISSING
                  else inspect.Parameter.empty))
                for f in dataclasses.fields(target) if f.init]
    return [(p.name, p.default) for p in inspect.signature(target).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"]


def _default(value) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    if isinstance(value, str) and value.endswith("()"):
        return f"`{value}`"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config object: its own section
        return f"`{type(value).__name__}()`"
    return f"`{value!r}`"


# Reference order: the training entry point and its config objects first, then what they plug in.
ORDER = ("train", "rl.RunConfig", "rl.DapoConfig", "rl.GenerationConfig", "rl.DataConfig", "rl.ShapeConfig",
         "rl.LossConfig", "rl.SafetyConfig", "tis.RolloutCorrectionConfig", "tis.from_preset", "rl.PrecisionConfig",
         "learner_jax.MemoryConfig", "rl.DiagnosticsConfig", "rl.EnvironmentConfig", "learner_jax.make_optimizer",
         "learner_jax.MeshConfig", "rl.MemoryPlan", "warmstart", "convert.convert_gguf", "tasks.", "engines.", "evaluate")


def _rank(name: str) -> int:
    return next((i for i, prefix in enumerate(ORDER) if name == prefix or (prefix.endswith(".") and
                                                                             name.startswith(prefix))), len(ORDER))


def owners() -> list[tuple[str, object]]:
    """(gin name, callable) for every registered configurable and every engine adapter's constructor."""
    from portable_rl import gin_utils
    from portable_rl.engines import registry
    from portable_rl.evaluate import evaluate
    from portable_rl.train import register_gin

    register_gin()
    gin_utils.register_configurable(evaluate, name="evaluate")
    seen, out = set(), []
    for name, fn in gin_utils._CONFIGURABLES.items():
        target = inspect.unwrap(fn)
        if id(target) in seen or (name.count(".") == 0 and any(n.endswith("." + name) and inspect.unwrap(f) is target
                                                               for n, f in gin_utils._CONFIGURABLES.items())):
            continue
        seen.add(id(target))
        out.append((name, target))
    for engine in registry.available_engines():
        try:
            factory = registry.get_engine_factory(engine)
        except Exception:  # noqa: BLE001  (an optional engine whose package is missing)
            continue
        out.append((f"engines.create_engine (name = '{engine}')", factory))
    return sorted(out, key=lambda item: _rank(item[0]))  # stable: registration order within a rank


def render() -> tuple[str, list[str]]:
    """The reference's markdown, and the knobs that have no meaning line (must be empty)."""
    lines = ["# Configuration reference", "",
             "Every knob a gin file can bind, with its default and meaning. Generated from the docstrings by",
             "`python -m portable_rl.config_reference`; do not edit by hand (tests/test_config_reference.py fails",
             "when it is stale). How the pieces fit: docs/training.md; a gin file written from scratch:",
             "docs/your-model.md.", ""]
    missing = []
    for name, obj in owners():
        meaning = documented_parameters(obj)
        params = [(p, d) for p, d in parameters(obj) if not (name.startswith("engines.create_engine (") and p == "name")]
        summary = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ")
        lines += [f"## `{name}`", "", summary, "", "| knob | default | meaning |", "|---|---|---|"]
        for param, default in params:
            text = meaning.get(param)
            if text is None:
                missing.append(f"{name}.{param}")
                text = ""
            lines.append(f"| `{param}` | {_default(default)} | {text.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines), missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale; write nothing")
    args = parser.parse_args(argv)
    text, missing = render()
    if missing:
        print(f"error: {len(missing)} knobs have no line in their owner's Args:/Attributes: section: "
              f"{', '.join(missing)}", file=sys.stderr)
        return 1
    if args.check:
        if not REFERENCE.exists() or REFERENCE.read_text() != text:
            print(f"{REFERENCE} is stale: run python -m portable_rl.config_reference", file=sys.stderr)
            return 1
        return 0
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
