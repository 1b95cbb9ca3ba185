"""A training run's weights as an HF checkpoint: `python -m portable_rl.export RUN_DIR OUT [--step N] [--dtype D]`.

A run saves orbax checkpoints (`RUN_DIR/checkpoints/<step>/`: params, optimizer, the base HF checkpoint's path).
Export restores one step's params onto the run's base model and writes OUT as the base's HF layout:
config.json, safetensors (in `--dtype`; default the params' own, float32 master weights) and the base's
tokenizer files. OUT then loads anywhere an HF checkpoint does: vLLM, transformers, `load_hf_model`, another
run's MODEL_PATH. Nothing half-written is left: OUT appears only once complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

from portable_rl.errors import UserError


def orbax_dir(path: Path) -> Optional[Path]:
    """The folder holding a run's step directories: `path/checkpoints` or `path` itself; None if neither."""
    for candidate in (path / "checkpoints", path):
        if candidate.is_dir() and any(p.name.isdigit() for p in candidate.iterdir()):
            return candidate
    return None


def load_run(run_dir: str | os.PathLike, *, step: Optional[int] = None, model_path: Optional[str] = None):
    """Restores a run's params (float32) onto its base model; returns (model, model_config, base, step).

    Args:
      run_dir: a training run directory or its checkpoints/ folder.
      step: the committed step to restore; None: the newest.
      model_path: the run's base HF checkpoint (config, tokenizer); None: the one recorded in the checkpoint.
    """
    import jax.numpy as jnp

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.learner_jax.checkpoint import Checkpointer

    ckpt_dir = orbax_dir(Path(run_dir))
    if ckpt_dir is None:
        raise UserError(f"{run_dir} holds no orbax checkpoints; pass a training run directory (RUN_DIR) or its "
                        "checkpoints/ folder")
    with Checkpointer(ckpt_dir) as ckpts:
        restored_step = step if step is not None else ckpts.latest_step()
        if restored_step is None:
            raise UserError(f"no committed checkpoint in {ckpt_dir}; train until a checkpoint step first")
        base = Path(model_path or ckpts.read_extra(restored_step).get("model_path", ""))
        if not (base / "config.json").exists():
            raise UserError(f"base HF checkpoint '{base}' not found; pass the run's starting checkpoint "
                            "(MODEL_PATH) as model_path / --model_path")
        model, model_config = load_hf_model(base, param_dtype=jnp.float32)
        ckpts.restore(model, None, step=restored_step)
    return model, model_config, base, restored_step


def export(*, run_dir: str, out: str, step: Optional[int] = None, dtype: Optional[str] = "float32",
           model_path: Optional[str] = None, overwrite: bool = False) -> str:
    """Writes step `step` (None: the newest) of `run_dir` to `out` as an HF checkpoint; returns `out`.

    `dtype`: the safetensors dtype (float32, bfloat16, float16); None: the base checkpoint's.
    """
    from portable_rl.convert.hf import copy_tokenizer_files, replace_dir, save_hf_model

    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()) and not overwrite:
        raise UserError(f"{out} exists and is not empty; choose a new OUT or pass --overwrite")
    model, config, base, restored_step = load_run(run_dir, step=step, model_path=model_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.export-", dir=out_path.parent))
    try:
        staged = staging / "hf"
        save_hf_model(model, config, staged, dtype=dtype)
        copy_tokenizer_files(base, staged)
        replace_dir(staged, out_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"[export] {run_dir} step {restored_step} -> {out} ({dtype or 'base dtype'}; base {base})", flush=True)
    return str(out_path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a training run directory (RUN_DIR) or its checkpoints/ folder")
    p.add_argument("out", help="the HF checkpoint directory to write")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the newest)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype on disk (default float32: the learner's master weights, exactly)")
    p.add_argument("--model_path", default=None, help="the run's base HF checkpoint (default: the recorded one)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    args = p.parse_args(argv)
    try:
        export(run_dir=args.run_dir, out=args.out, step=args.step, dtype=args.dtype, model_path=args.model_path,
               overwrite=args.overwrite)
    except (UserError, FileNotFoundError) as e:
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None


if __name__ == "__main__":
    sys.exit(main())
