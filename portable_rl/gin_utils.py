"""Gin plumbing for the entry points (T5X style). Library code never imports gin; this module does.

Command line (train.py / evaluate.py / warmstart.py):
    --gin_file=FILE          repeatable; relative names are looked up in the search paths
    --gin.NAME=VALUE         repeatable; same as a line `NAME = VALUE` after all files
                             (macros: --gin.TRAIN_STEPS=3; parameters: --gin.train.seed=1)
    --gin_bindings='X = Y'   repeatable, the long form
    --gin_search_paths=DIR   repeatable, comma-separated allowed; searched before the package's gin/

The repository's `gin/` folder (next to the `portable_rl` package) and the current directory are always
searched, so `--gin_file=gin/dapo_fp8.gin` and `--gin_file=dapo_fp8.gin` both work from anywhere.
Library callables are registered here with `gin.external_configurable`, under short module names
(`tasks.ArithmeticTask`, `engines.create_engine`, `tis.RolloutCorrectionConfig`, ...). The config objects
(`rl.RunConfig`, `rl.GenerationConfig`, `learner_jax.MemoryConfig`, ...) are bound field by field; an argument of
`train` (or a part of `rl.DapoConfig`) that the gin files do not set explicitly is built from its class's
bindings, so `rl.LossConfig.ppo_epochs = 2` takes effect on its own. A binding renamed when the config
objects replaced the flat keywords, or a configurable renamed to match its module path, fails with one line
naming the new one (`MOVED`, `RENAMED`).

Bad input ends the program with one line naming the fix, no traceback: gin errors (unknown parameter,
unknown configurable, missing REQUIRED macro) and every `portable_rl.errors.UserError` (unknown engine /
reward, malformed dataset, tokenizer/model vocabulary mismatch, corrupt checkpoint, rejected weight push,
an engine fleet the cluster cannot place, too many non-finite rollout logprobs, a sequence over the
micro-batch token budget, a memory knob this machine cannot run, ...) plus missing or unreadable files.
Set `PORTABLE_RL_TRACEBACK=1` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import inspect
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

import gin

import portable_rl
from portable_rl.errors import USER_ERRORS, ConfigError

PACKAGE_GIN_DIR = Path(portable_rl.__file__).resolve().parent.parent / "gin"
_REGISTERED = False
_CONFIGURABLES: dict[str, Callable] = {}  # gin name ("train", "tasks.ArithmeticTask") -> callable


def default_search_paths() -> list[str]:
    """The package's gin/ folder first (includes name files relative to it), then the repo root."""
    return [str(PACKAGE_GIN_DIR), str(PACKAGE_GIN_DIR.parent)]


def register_configurable(fn: Callable, name: str | None = None, module: str | None = None):
    """`gin.external_configurable` that tolerates a second registration of the same name."""
    short = name or getattr(fn, "__name__", "")
    _CONFIGURABLES.update({short: fn, f"{module}.{short}" if module else short: fn})
    try:
        return gin.external_configurable(fn, name=name, module=module)
    except ValueError as e:
        if "already" not in str(e):
            raise
        return fn


def with_config_defaults(cls_or_fn: Callable, defaults: dict[str, Callable]) -> Callable:
    """`cls_or_fn` whose arguments named in `defaults`, when not passed (or None), are built by calling the
    gin-configured callable there: the config objects' own bindings apply without a `@Config()` reference."""
    @functools.wraps(cls_or_fn)
    def build(**kwargs):
        for name, make in defaults.items():
            if kwargs.get(name) is None:
                kwargs[name] = make()
        return cls_or_fn(**kwargs)
    return build


CONFIG_OBJECTS: dict[str, Callable] = {}  # train()'s config arguments → their gin-configured classes


def register_library() -> None:
    """Registers the gin-free library callables that gin files may reference. The entry points register
    their own functions (`train` with `warmstart`, `evaluate`, `warmstart`), so none is imported here."""
    global _REGISTERED
    if _REGISTERED:
        return
    from portable_rl import tasks
    from portable_rl.engines import registry
    from portable_rl import tis
    from portable_rl.learner_jax.memory import MemoryConfig
    from portable_rl.rl import config as rl_config, dapo

    for cls in (tasks.ArithmeticTask, tasks.MathDatasetTask, tasks.WordProblemsTask, tasks.SqlTask, tasks.SkyrlSqlTask,
                tasks.SqlTraceTask):
        register_configurable(cls, module="tasks")
    register_configurable(registry.create_engine, name="create_engine", module="engines")
    register_configurable(tis.from_preset, name="from_preset", module="tis")
    parts = {name: register_configurable(cls, module="rl") for name, cls in dapo_parts().items()}
    CONFIG_OBJECTS.update(
        run_config=register_configurable(rl_config.RunConfig, module="rl"),
        dapo=register_configurable(with_config_defaults(dapo.DapoConfig, parts), name="DapoConfig", module="rl"),
        correction=register_configurable(tis.RolloutCorrectionConfig, module="tis"),
        precision=register_configurable(rl_config.PrecisionConfig, module="rl"),
        memory=register_configurable(MemoryConfig, module="learner_jax"),
        diagnostics=register_configurable(rl_config.DiagnosticsConfig, module="rl"),
        environment=register_configurable(rl_config.EnvironmentConfig, module="rl"))
    from portable_rl.learner_jax import optim, sharding

    register_configurable(optim.make_optimizer, name="make_optimizer", module="learner_jax")
    register_configurable(sharding.MeshConfig, module="learner_jax")
    from portable_rl.convert import gguf

    register_configurable(gguf.convert_gguf, name="convert_gguf", module="convert")  # SmolLM2 from PyPI
    from portable_rl.rl.colocation import MemoryPlan

    register_configurable(MemoryPlan, module="rl")  # gin/colocate.gin
    _REGISTERED = True


def register_train(train: Callable) -> Callable:
    """`train` registered as gin's `train`, its config arguments built from their classes' bindings
    (`portable_rl.train.register_gin` also registers the warm start its default run names)."""
    register_library()
    return register_configurable(with_config_defaults(train, CONFIG_OBJECTS), name="train")


def dapo_parts() -> dict[str, type]:
    """`rl.DapoConfig`'s parts: field name → its config class (`rl.GenerationConfig`, ...)."""
    import dataclasses

    from portable_rl.rl.dapo import DapoConfig

    return {f.name: f.default_factory for f in dataclasses.fields(DapoConfig)}


# Bindings of the flat keywords that the config objects replaced → where they live now.
MOVED = {
    **{f"train.{name}": f"rl.RunConfig.{name}" for name in (
        "run_dir", "train_steps", "model_path", "seed", "chat_template", "async_rollouts", "eval_every",
        "eval_max_tokens", "eval_size", "checkpoint_every", "keep_checkpoints")},
    **{f"train.{name}": f"rl.PrecisionConfig.{name}" for name in (
        "param_dtype", "master_dtype", "compute_dtype", "smoothquant_alpha")},
    **{f"train.{name}": f"learner_jax.MemoryConfig.{name}" for name in (
        "attention_impl", "pack_sequences", "share_prompts", "max_tokens_per_micro_batch", "logprob_chunk_tokens",
        "remat")},
    "train.probe_prompts": "rl.DiagnosticsConfig.probe_prompts",
    "train.update_survival_stride": "rl.DiagnosticsConfig.update_survival_stride (0 as off: "
                                    "rl.DiagnosticsConfig.disabled = ['update_survival'])",
    "train.mismatch_split": "rl.DiagnosticsConfig.disabled = ['mismatch_split'] (to turn it off)",
    "train.progress": "nothing: the progress bar shows on a terminal only",
    "train.run": "train.run_config",
    "train.algorithm": "train.dapo",
}


# Configurables renamed so that gin names match module paths → their names now. (`MemoryPlan`, now
# `rl.MemoryPlan`, is not here: gin still resolves the bare name, as it does every unambiguous short name.)
RENAMED = {"learner.MemoryConfig": "learner_jax.MemoryConfig", "optim.make_optimizer": "learner_jax.make_optimizer",
           "sharding.MeshConfig": "learner_jax.MeshConfig"}


def moved_dapo_fields() -> dict[str, str]:
    """`rl.DapoConfig.<field>` → `rl.<Part>.<field>` for every field of DapoConfig's parts."""
    import dataclasses

    return {f"rl.DapoConfig.{f.name}": f"rl.{cls.__name__}.{f.name}" for cls in dapo_parts().values()
            for f in dataclasses.fields(cls)}


def rewrite_gin_args(argv: Sequence[str]) -> list[str]:
    """`--gin.NAME=VALUE` / `--gin.NAME VALUE` → `--gin_bindings=NAME = VALUE`."""
    out, i = [], 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--gin.") and arg != "--gin.":
            body = arg[len("--gin."):]
            if "=" in body:
                name, value = body.split("=", 1)
            elif i + 1 < len(argv):
                name, value = body, argv[i + 1]
                i += 1
            else:
                raise SystemExit(f"error: {arg} has no value; write --gin.NAME=VALUE")
            out.append(f"--gin_bindings={name} = {_as_gin_value(value)}")
        else:
            out.append(arg)
        i += 1
    return out


def _as_gin_value(value: str) -> str:
    """Bare words become strings, so --gin.RUN_DIR=/tmp/run works without inner quotes.

    Anything gin would read as a value (numbers, quoted strings, True/None, @refs, %macros, containers)
    is passed through unchanged.
    """
    text = value.strip()
    if not text or text[0] in "@%'\"([{" or text in ("True", "False", "None"):
        return value
    try:
        ast.literal_eval(text)
        return value
    except (ValueError, SyntaxError):
        return repr(text)


def make_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    p.add_argument("--gin_bindings", action="append", default=[], help="gin binding 'NAME = VALUE' (repeatable)")
    p.add_argument("--gin_search_paths", action="append", default=[],
                   help="extra directories to find gin files in (repeatable, comma-separated)")
    return p


def parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str] = (),
              gin_search_paths: Sequence[str] = ()) -> None:
    """Registers the library, adds search paths and parses files then bindings (bindings win)."""
    register_library()
    searches = [p for s in gin_search_paths for p in s.split(",") if p] + default_search_paths() + [os.getcwd()]
    for path in searches:
        gin.add_config_file_search_path(path)
    if not gin_files:
        raise SystemExit("error: no --gin_file given; e.g. --gin_file=gin/dapo_fp8.gin")
    quiet = _DropMisses()
    logging.getLogger().addFilter(quiet)  # gin logs every search-path miss before finding an include
    try:
        gin.parse_config_files_and_bindings(list(gin_files), list(gin_bindings), finalize_config=True)
    finally:
        logging.getLogger().removeFilter(quiet)


class _DropMisses(logging.Filter):
    def filter(self, record):
        return not str(record.msg).startswith("Path not found")


# ------------------------------------------------------------------------------- gin files: silent traps
LENGTH_MACROS = ("MAX_MODEL_LEN", "MAX_RESPONSE_TOKENS")


def unused_macros() -> list[str]:
    """Macros bound (by a file or --gin.NAME) that no binding reads, directly or through a read macro."""
    config = gin.config._CONFIG  # gin exposes no public view of the macro table
    macros = {scope for (scope, selector) in config if selector == "gin.macro"}

    def refs(value, out):
        if isinstance(value, gin.config.ConfigurableReference):
            if value.configurable.name == "macro":
                out.add(value.scopes[-1])
        elif isinstance(value, dict):
            for v in value.values():
                refs(v, out)
        elif isinstance(value, (list, tuple)):
            for v in value:
                refs(v, out)
        return out

    read = set()
    for (scope, selector), params in config.items():
        if selector != "gin.macro":
            for v in params.values():
                refs(v, read)
    frontier = set(read)
    while frontier:  # macros read through read macros
        new = set()
        for m in frontier:
            refs(config[(m, "gin.macro")]["value"], new)
        frontier = new - read
        read |= new
    return sorted(macros - read)


def length_resets(gin_files, bindings, search_paths) -> list[str]:
    """Length macros (MAX_MODEL_LEN, MAX_RESPONSE_TOKENS) lowered by a gin file parsed after another file set
    them (the trap: composing engines/vllm.gin after a model file resets MAX_MODEL_LEN to 64). Files are read in
    gin's order, includes in place; a --gin.NAME binding, or a file lowering what a file it includes set (a
    recipe's own choice), is deliberate and not reported."""
    history: dict[str, list[tuple[str, str, tuple]]] = {}   # macro → [(file, value, its includers)] in parse order

    def find(name, parent):
        for d in [Path(parent).parent, *map(Path, search_paths), Path.cwd()]:
            if (d / name).exists():
                return d / name
        return None

    def walk(path: Path, seen: tuple):
        if path in seen:
            return
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            inc = re.match(r"include\s+['\"](.+)['\"]", line)
            m = re.match(r"([A-Z][A-Z0-9_]*)\s*=\s*(.+)$", line)
            if inc:
                child = find(inc.group(1), path)
                if child is not None:
                    walk(child, seen + (path,))
            elif m and m.group(1) in LENGTH_MACROS:
                history.setdefault(m.group(1), []).append((str(path), m.group(2).strip(), tuple(map(str, seen))))

    for f in gin_files:
        p = find(f, Path.cwd() / "-")
        if p is not None:
            walk(p.resolve(), ())
    out = []
    for name, entries in history.items():
        for (f0, v0, includers0), (f1, v1, _) in zip(entries, entries[1:]):
            try:
                lowered = int(ast.literal_eval(v1)) < int(ast.literal_eval(v0))
            except (ValueError, SyntaxError):
                continue
            final = [b for b in bindings if re.match(rf"\s*{name}\s*=", b)]
            overrides_own_include = f1 in includers0   # a recipe setting a length its included model file set
            if lowered and f0 != f1 and not overrides_own_include and not final:
                out.append(f"{name} = {v0} ({_short(f0)}) was reset to {v1} by {_short(f1)}, read after it; compose "
                           f"{_short(f1)} before the file that sets {name}, or set {name} again last")
    return out


def _short(path: str) -> str:
    parts = Path(path).parts
    return "/".join(parts[parts.index("gin"):]) if "gin" in parts else path


def gin_traps(gin_files: Sequence[str], gin_bindings: Sequence[str] = (),
              gin_search_paths: Sequence[str] = ()) -> list[str]:
    """The parsed config's silent traps, one line each: macros bound and never read (`unused_macros`), and
    length macros lowered by a later file (`length_resets`). Call after `parse_gin` with its arguments."""
    searches = [p for s in gin_search_paths for p in s.split(",") if p] + default_search_paths()
    traps = [f"macro {name} is bound but nothing reads it" for name in unused_macros()]
    return traps + length_resets(gin_files, gin_bindings, searches)


def run(main: Callable[[], None], argv: Sequence[str] | None = None, description: str = "",
        warn_traps: bool = False) -> None:
    """Parses flags, parses gin, then calls `main()` whose configurable parameters gin fills in.

    Gin errors (unknown parameter, missing REQUIRED macro, bad syntax) end the program with one line.
    `warn_traps`: first print a `warning:` line on stderr per silent trap of the config (`gin_traps`).
    """
    argv = rewrite_gin_args(sys.argv[1:] if argv is None else argv)
    args = make_parser(description).parse_args(argv)
    try:
        parse_gin(args.gin_file, args.gin_bindings, args.gin_search_paths)
    except (ValueError, TypeError, KeyError, IOError) as e:
        exit_gin_error(e)
    if warn_traps:
        for trap in gin_traps(args.gin_file, args.gin_bindings, args.gin_search_paths):
            print(f"warning: {trap}", file=sys.stderr, flush=True)
    try:
        main()
    except Exception as e:
        if os.environ.get("PORTABLE_RL_TRACEBACK"):
            raise
        if isinstance(e, (ValueError, TypeError)) and "Required bindings" in str(e):
            exit_gin_error(e)
        if isinstance(e, USER_ERRORS):
            raise SystemExit(f"error: {one_line(e)}") from e
        raise


def one_line(e: BaseException) -> str:
    """The exception's message on one line, without the call chain gin appends to it."""
    text = str(e).split("\n  In call to configurable")[0]
    return " ".join(text.split())


def exit_gin_error(e: BaseException):
    if os.environ.get("PORTABLE_RL_TRACEBACK"):
        raise e
    msg = " ".join(str(e).split())
    hint = _hint(msg)
    required = re.findall(r"(\w+)/macro\.value set to `%gin\.REQUIRED`", msg)
    if required:
        raise SystemExit(f"gin config error: required macro {required[0]} is not set; pass "
                         f"--gin.{required[0]}=VALUE (see the gin file's header)") from e
    raise SystemExit(f"gin config error: {msg}{hint} -- fix the --gin_file / --gin.NAME=VALUE named here "
                     f"(gin files list the macros that must be set in their header)") from e


def _hint(msg: str) -> str:
    """For a moved binding: its new name; for an unknown parameter: the close match or the valid ones; for an
    unknown reference: the known ones."""
    bad_param = re.search(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", msg)
    moved = {**MOVED, **moved_dapo_fields()}.get(f"{bad_param.group(1)}.{bad_param.group(2)}") if bad_param else None
    if moved:
        return f" (it moved: set {moved})"
    if bad_param and bad_param.group(1) in _CONFIGURABLES:
        params = _parameters(_CONFIGURABLES[bad_param.group(1)])
        close = difflib.get_close_matches(bad_param.group(2), params, n=1)
        if close:
            return f" (did you mean {close[0]!r}?)"
        return f" (parameters of {bad_param.group(1)}: {', '.join(params)})"
    unknown = re.search(r"No configurable matching (?:reference )?'@?([\w./]+?)(?:\(\))?'", msg)
    renamed = RENAMED.get(unknown.group(1).split("/")[-1]) if unknown else None
    if renamed:
        return f" (it was renamed: use {renamed})"
    bad_ref = re.search(r"No configurable matching reference '@([\w./]+?)(\(\))?'", msg)
    if bad_ref:
        wanted = bad_ref.group(1).split("/")[-1]
        module = wanted.rsplit(".", 1)[0] if "." in wanted else None
        known = sorted(n for n in _CONFIGURABLES if "." in n and (module is None or n.startswith(module + ".")))
        if known:
            return f" (registered: {', '.join('@' + n for n in known)})"
    return ""


def _parameters(fn: Callable) -> list[str]:
    try:
        return [p for p in inspect.signature(fn).parameters if p not in ("self", "args", "kwargs")]
    except (TypeError, ValueError):
        return []


def query_value(name: str):
    """`gin.query_parameter` that resolves macros (`%RUN_DIR`) to their values."""
    value = gin.query_parameter(name)
    if isinstance(value, gin.config.ConfigurableReference) and value.configurable.name == "macro":
        value = value.scoped_configurable_fn()  # a macro evaluates to its (recursively resolved) value
    return value


def memory_budget(binding: str = "train.memory_plan"):
    """The memory plan the config binds (gin/colocate.gin: `train.memory_plan = %MEMORY_PLAN`), completed from
    the run's own config (`run_memory_plan`), decided, with XLA's variables set and its line printed
    (`rl.colocation.prepare`), or None when nothing binds it. The entry points call this before JAX starts its
    devices."""
    plan = run_memory_plan(binding)
    if plan is None:
        return None
    from portable_rl.rl.colocation import prepare

    return prepare(plan)


def run_memory_plan(binding: str = "train.memory_plan", learner_devices: int | None = None):
    """The bound `MemoryPlan` with what the run's config already says filled in, so nothing is set twice: the
    checkpoint (rl.RunConfig.model_path), the learner's dtypes (rl.PrecisionConfig), its shards (the mesh's
    fsdp x tensor), and the engine's name, quantization, length and tensor-parallel size (its binding).
    `learner_devices`: the devices a -1 mesh axis fills (None: this host's GPUs x the JAX processes). None when
    nothing binds a plan."""
    try:
        value = gin.query_parameter(binding)
    except ValueError:  # not bound: the default run
        return None
    plan = value.scoped_configurable_fn() if isinstance(value, gin.config.ConfigurableReference) else value
    if plan is None:
        return None
    from portable_rl.rl.colocation import MemoryPlan, detect_device_memory

    if not isinstance(plan, MemoryPlan):
        return plan
    engine = engine_settings()
    precision = CONFIG_OBJECTS["precision"]()
    mesh = bound("train.mesh")
    if isinstance(mesh, gin.config.ConfigurableReference):
        mesh = mesh.scoped_configurable_fn()
    shards = 1  # no mesh: the learner on one device
    if mesh is not None:
        from portable_rl.learner_jax.sharding import mesh_shape

        sizes = (mesh.data, mesh.fsdp, mesh.expert, mesh.tensor)
        if -1 not in sizes:
            learner_devices = math.prod(sizes)
        elif learner_devices is None:  # before JAX starts: nvidia-smi's GPUs on this host x the processes
            processes = int(os.environ.get("PORTABLE_RL_NUM_PROCESSES", os.environ.get("SLURM_NTASKS", 1)))
            learner_devices = max(1, detect_device_memory()[1]) * processes
        _, fsdp, expert, tensor = mesh_shape(mesh, learner_devices)
        shards = fsdp * expert * tensor  # the learner's state is split over fsdp, expert (the experts) and tensor
    return plan.for_run(model_path=bound("rl.RunConfig.model_path", ""), precision=precision, learner_shards=shards,
                        engine=engine)


def resolve(value):
    """A binding's value with every %MACRO inside it (dicts, lists) replaced by the macro's value."""
    if isinstance(value, gin.config.ConfigurableReference) and value.configurable.name == "macro":
        return resolve(gin.query_parameter(f"{value.scoped_selector}.value"))
    if isinstance(value, dict):
        return {k: resolve(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(resolve(v) for v in value)
    return value


def bound(name: str, default=None):
    """The resolved value bound to `name` ('scope/module.fn.param' or 'MACRO'), else `default`."""
    key = f"{name}/gin.macro.value" if "." not in name else name
    try:
        return resolve(gin.query_parameter(key))
    except ValueError:
        return default


def engine_settings():
    """The memory-relevant settings of the engine `train.engine_factory` binds (`planning.engine.EngineSettings`)."""
    from portable_rl.planning.engine import EngineSettings

    try:
        ref = gin.query_parameter("train.engine_factory")
        while isinstance(ref, gin.config.ConfigurableReference) and ref.configurable.name == "macro":
            ref = gin.query_parameter(f"{ref.scoped_selector}.value")
    except ValueError:
        raise ConfigError("the config binds no train.engine_factory; compose an engine file "
                          "(--gin_file=gin/engines/vllm.gin)") from None
    prefix = "/".join(ref.scopes + [ref.configurable.selector])
    name = bound(f"{prefix}.name")
    kwargs = bound(f"{prefix}.engine_init_kwargs", {}) or {}
    if name == "vllm":
        return EngineSettings(name, kwargs.get("quantization"), int(kwargs.get("tensor_parallel_size", 1)),
                              int(bound(f"{prefix}.max_model_len", 2048)),
                              kwargs.get("gpu_memory_utilization", bound(f"{prefix}.gpu_memory_utilization")), True)
    if name == "sglang":
        length = kwargs.get("context_length", bound("MAX_MODEL_LEN"))
        if length is None:
            raise ConfigError("SGLang engine: set 'context_length' in ENGINE_KWARGS (the planner sizes the KV cache "
                              "from it)")
        return EngineSettings(name, bound(f"{prefix}.fp8_mode"), int(kwargs.get("tp_size", 1)), int(length),
                              kwargs.get("mem_fraction_static"), bool(bound(f"{prefix}.sleep_mode", False)))
    raise ConfigError(f"engine {name!r}: the planner sizes 'vllm' and 'sglang' engines; plan a Ray fleet per "
                      "engine node with gin/engines/vllm.gin")


def write_config(run_dir: str | os.PathLike, name: str = "config.gin", operative: bool = False) -> Path:
    """Writes the full parsed config (or the operative one: values actually used) into run_dir."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / name
    path.write_text(gin.operative_config_str() if operative else gin.config_str())
    return path
