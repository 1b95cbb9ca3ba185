"""Training checkpoints with orbax: model params, optimizer state, step, RNG key and a JSON dict.

Layout: `<dir>/<step>/{model, optimizer, meta}` written by `orbax.checkpoint.CheckpointManager` (which writes to
a temporary directory and renames it), plus `<dir>/<step>/COMMITTED`, written by us only after
orbax has finished. A step directory without `COMMITTED` (a crash mid-write, a partial copy) is
never restored: `latest_step` skips it and opening a `Checkpointer` moves it aside to
`<dir>/incomplete-<step>-<ns>` (nothing is deleted). Saving is
synchronous so the marker always means "fully on disk". The newest `max_to_keep` steps are kept.

The marker lists every file of the step with its size. A committed step whose files are missing,
truncated or unreadable (or that was written for a different model) raises `CheckpointError` naming
the directory and the fix: move it aside to resume from the previous committed step. It is not skipped
silently: a committed step that fails to read means damaged storage or a wrong RUN_DIR, and a silent
fallback would throw away training and the metrics logged since the previous step without a word.
(Sizes catch truncation and missing files, not bit flips inside a file of the right size.)

Several JAX processes (a multi-host learner): every process calls `save` / `restore` with its part of
the sharded arrays; orbax writes each shard once (replicated ones from one process) and reads back what
each process needs. Process 0 alone moves incomplete steps aside and writes `COMMITTED`, after a barrier
that every process reaches only once its shards are written; a process that dies mid-save never gets
there, so its step stays uncommitted. The directory must be shared by all processes (one box, NFS, GCS).

    ckpt = Checkpointer(directory, max_to_keep=3)
    ckpt.save(step, model, optimizer, extra={"data_cursor": 123}, rng=key)
    restored = ckpt.restore(model, optimizer)        # updates model / optimizer in place
    restored.step, restored.extra, restored.rng
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from portable_rl.errors import UserError

COMMIT_MARKER = "COMMITTED"
_log = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint directory that cannot be used: unreadable, or a committed step that fails to restore."""


def _step_dirs(directory: Path) -> dict[int, Path]:
    if not directory.exists():
        return {}
    return {int(p.name): p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()}


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """Steps under `directory` whose checkpoint finished writing, ascending."""
    return sorted(s for s, p in _step_dirs(Path(directory)).items() if (p / COMMIT_MARKER).exists())


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest fully written step under `directory`, or None if there is none."""
    steps = committed_steps(directory)
    return steps[-1] if steps else None


@dataclasses.dataclass
class Restored:
    step: int
    extra: dict
    rng: jax.Array | None


class Checkpointer:
    """Saves and restores (model params, optimizer state, step, rng, extra JSON) under `directory`."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3):
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} is a file; move it away or choose "
                                  f"another run directory (RUN_DIR)")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if jax.process_index() == 0:
                self._move_incomplete_aside()
        except OSError as e:
            raise CheckpointError(f"cannot use checkpoint directory {self.directory} ({e.strerror or e}); "
                                  f"fix its permissions or choose another run directory (RUN_DIR)") from e
        _barrier("checkpoint directory ready")  # every process then lists the same committed steps
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=False))

    def _move_incomplete_aside(self) -> None:
        for step, path in _step_dirs(self.directory).items():
            if not (path / COMMIT_MARKER).exists():
                # Moved aside, not deleted: frees the step number and loses nothing.
                aside = self.directory / f"incomplete-{step}-{time.time_ns()}"
                _log.warning("moving incomplete checkpoint %s (no %s marker) to %s", path, COMMIT_MARKER, aside)
                os.rename(path, aside)

    def latest_step(self) -> int | None:
        return latest_step(self.directory)

    def all_steps(self) -> list[int]:
        return committed_steps(self.directory)

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer | None = None, *,
             extra: dict | None = None, rng: jax.Array | None = None) -> None:
        """Writes checkpoint `step` (blocking); `extra` must be JSON-serialisable."""
        extra = dict(extra or {})
        json.dumps(extra)  # fail before writing anything if it is not JSON
        meta = {"extra": extra, "has_optimizer": optimizer is not None, "rng": _rng_to_json(rng)}
        items = {"model": ocp.args.StandardSave(_str_keys(nnx.to_pure_dict(nnx.state(model, nnx.Param)))),
                 "meta": ocp.args.JsonSave(meta)}
        if optimizer is not None:
            items["optimizer"] = ocp.args.StandardSave(_str_keys(nnx.to_pure_dict(nnx.state(optimizer))))
        self._manager.save(step, args=ocp.args.Composite(**items))
        self._manager.wait_until_finished()
        _barrier(f"checkpoint {step} written")  # every process's shards are on disk
        if jax.process_index() == 0:
            step_dir = self.directory / str(step)
            marker = step_dir / COMMIT_MARKER
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step, "files": _file_sizes(step_dir)}) + "\n")
            os.replace(tmp, marker)
        _barrier(f"checkpoint {step} committed")

    def _committed_step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(f"no committed checkpoint {'' if step is None else step} in "
                                    f"{self.directory}; train from scratch or pass an existing step")
        return step

    def _meta(self, step: int) -> dict:
        self._check_files(step)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            raise self._restore_error(step, e) from e

    def _check_files(self, step: int) -> None:
        """Every file the commit marker lists is there with its size (markers before sizes list none)."""
        step_dir = self.directory / str(step)
        try:
            saved = json.loads((step_dir / COMMIT_MARKER).read_text()).get("files", {})
            now = _file_sizes(step_dir)
        except (OSError, ValueError) as e:
            raise self._restore_error(step, e) from e
        for name, size in saved.items():
            if now.get(name) != size:
                found = "is missing" if name not in now else f"has {now[name]} bytes"
                raise self._restore_error(step, f"{name} {found}, {size} when saved")

    def _restore_error(self, step: int, cause) -> CheckpointError:
        path = self.directory / str(step)
        earlier = [s for s in self.all_steps() if s < step]
        then = f"resume from step {earlier[-1]}" if earlier else "start from the model again"
        reason = " ".join(str(cause).split()).split(" Truncating/padding is disabled")[0][:300]
        return CheckpointError(f"checkpoint {path} cannot be restored ({reason}); if it is damaged, move it "
                               f"aside (mv {path} {self.directory}/corrupt-{step}) to {then}; if it belongs to "
                               f"a different model, use another run directory")

    def read_extra(self, step: int | None = None) -> dict:
        """The JSON `extra` saved with `step` (default: the latest committed one); loads no arrays."""
        return self._meta(self._committed_step(step))["extra"]

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None, *,
                step: int | None = None) -> Restored:
        """Loads `step` (default: the latest committed one) into `model` / `optimizer` in place."""
        step = self._committed_step(step)
        meta = self._meta(step)
        if optimizer is not None and not meta["has_optimizer"]:
            raise ValueError(f"checkpoint {step} has no optimizer state; restore with optimizer=None")
        modules = {"model": (model, nnx.Param)}
        if optimizer is not None:
            modules["optimizer"] = (optimizer, ...)
        states = {name: nnx.state(module, what) for name, (module, what) in modules.items()}
        targets = {name: nnx.to_pure_dict(state) for name, state in states.items()}
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                **{name: ocp.args.StandardRestore(_str_keys(t)) for name, t in targets.items()}))
            values = {name: _orig_keys(targets[name], restored[name]) for name in modules}
        except Exception as e:  # nothing has been written into model / optimizer yet (orbax checks shapes)
            raise self._restore_error(step, e) from e
        for name, (module, _) in modules.items():
            nnx.replace_by_pure_dict(states[name], values[name])
            nnx.update(module, states[name])
        return Restored(step=step, extra=meta["extra"], rng=_rng_from_json(meta["rng"]))

    def close(self) -> None:
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_barriers = 0


def _barrier(name: str, timeout_s: int = 3600) -> None:
    """All JAX processes wait here (JAX's coordination service); nothing with one process. Every process
    makes the same barrier calls in the same order, so the counter gives each one the same unique id."""
    global _barriers
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    _barriers += 1
    distributed.global_state.client.wait_at_barrier(f"{name} #{_barriers}", timeout_in_ms=timeout_s * 1000)


def _file_sizes(step_dir: Path) -> dict[str, int]:
    """{path relative to the step directory: bytes} of every file but the commit marker."""
    return {str(p.relative_to(step_dir)): p.stat().st_size for p in sorted(step_dir.rglob("*"))
            if p.is_file() and p.name not in (COMMIT_MARKER, COMMIT_MARKER + ".tmp")}


def _str_keys(tree):
    """Orbax stores dict keys as strings; optimizer states have int keys (tuple positions)."""
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _orig_keys(like, restored):
    """`restored` (string keys) with the keys of `like` (its original pure dict)."""
    if isinstance(like, dict):
        return {k: _orig_keys(v, restored[str(k)]) for k, v in like.items()}
    return restored


def _rng_to_json(rng) -> dict | None:
    """A PRNG key (typed or raw uint32) as JSON: it is a handful of integers."""
    if rng is None:
        return None
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    data = np.asarray(jax.random.key_data(rng) if typed else rng)
    return {"typed": bool(typed), "impl": str(jax.random.key_impl(rng)) if typed else None,
            "dtype": data.dtype.name, "data": data.tolist()}


def _rng_from_json(info: dict | None):
    if info is None:
        return None
    data = jax.numpy.asarray(np.asarray(info["data"], dtype=info["dtype"]))
    return jax.random.wrap_key_data(data, impl=info["impl"]) if info["typed"] else data
