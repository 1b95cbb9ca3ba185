"""Evaluation entry point: `python -m portable_rl.evaluate --gin_file=gin/eval/arithmetic.gin --gin.CHECKPOINT=DIR`.

CHECKPOINT is either an HF directory (config.json + safetensors; the engine loads it as is) or a training
run directory / its `checkpoints/` folder (orbax): then the base HF checkpoint the run started from
(recorded in the checkpoint, or MODEL_PATH) is loaded by the engine and the trained weights are pushed
into it, exactly as during training. Any registered engine works (`engines.create_engine.name`).

Reports accuracy (mean per-sample correctness), pass@k (unbiased estimator, k ≤ n), mean response length and
mean turns (multi-turn environments, `rl.EnvironmentConfig`: e.g. execution accuracy on the SQL task);
writes a JSON report (summary + per-sample records) and prints a table.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from portable_rl.export import load_run, orbax_dir
from portable_rl.rl.config import EnvironmentConfig


def evaluate(*, checkpoint: str, engine_factory: Callable, task, model_path: Optional[str] = None,
             step: Optional[int] = None, n_samples: int = 1, temperature: float = 0.0,
             max_tokens: int = 64, ks: Sequence[int] = (1,), max_examples: Optional[int] = None,
             chat_template: bool = False, seed: int = 0, report_path: Optional[str] = None,
             xla_preallocate: bool = False,
             environment: Optional[EnvironmentConfig] = None) -> dict:
    """Evaluates `checkpoint` on `task.eval_examples()`; returns the report dict (also written as JSON).

    Args:
      checkpoint: an HF checkpoint directory, or a training run directory / its checkpoints/ folder (the
        trained weights are then pushed into the engine started on the run's base checkpoint).
      engine_factory: builds the rollout engine: `engine_factory(model_path=...)` (`engines.create_engine`).
      task: the held-out examples and the reward (`tasks.*`).
      model_path: the base HF checkpoint of a run directory; None: the one recorded in the checkpoint. Unused
        for an HF checkpoint.
      step: the run checkpoint's step restored; None: the newest.
      n_samples: responses sampled per problem.
      temperature: the sampling temperature; 0: greedy.
      max_tokens: the longest response the engine may generate.
      ks: the k of each pass@k reported; a k above n_samples is left out.
      max_examples: evaluate the first this many held-out examples; None: all.
      chat_template: wrap prompts in the tokenizer's chat template.
      seed: the sampling seed (unused at temperature 0).
      report_path: where the JSON report is written; None: eval_<task name>[_step<N>].json in `checkpoint`
        for a run directory, else in the current directory.
      xla_preallocate: let XLA preallocate device memory as usual; False: XLA_PYTHON_CLIENT_PREALLOCATE=false
        (unless exported), since JAX here only holds the restored params for one push and the engine's
        GPU_MEMORY_UTILIZATION share stays free for it (rl/colocation.py). No effect on CPU.
      environment: what each trajectory runs in and when it ends (`rl.EnvironmentConfig`, training's); None:
        the default, the task's prompt, one turn, scored by its reward. `max_tokens` bounds each turn.
    """
    if not xla_preallocate:  # before JAX starts its devices (the checkpoint restore below)
        from portable_rl.rl.colocation import PREALLOCATE

        os.environ.setdefault(PREALLOCATE, "false")
    from portable_rl.engines.base import SamplingConfig
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.evaluation import evaluate_examples
    from portable_rl.rl.turns import task_reward

    environment = environment or EnvironmentConfig()
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist; set CHECKPOINT to an HF dir or a run dir")
    t0 = time.perf_counter()
    run = None if (checkpoint / "config.json").exists() else orbax_dir(checkpoint)
    restored_step = None
    if run is None:
        if not (checkpoint / "config.json").exists():
            raise FileNotFoundError(f"{checkpoint} is neither an HF checkpoint (config.json) nor a run directory "
                                    "with orbax checkpoints")
        base = checkpoint
    else:
        model, model_config, base, restored_step = load_run(run, step=step, model_path=model_path)

    codec = TextCodec(base, chat_template=chat_template)
    examples = list(task.eval_examples())[:max_examples]
    reward_fn = task_reward(environment, task, examples[0])  # None: the environment scores (e.g. 'sql')
    sampling = SamplingConfig(temperature=temperature, n=n_samples, max_tokens=max_tokens,
                              seed=None if temperature == 0 else seed, stop_token_ids=(codec.eos_id,))
    engine = engine_factory(model_path=str(base))
    try:
        if run is not None:
            from portable_rl.rl.sync import push_weights
            push_weights(engine, model, model_config)
        summary, records = evaluate_examples(engine, codec, examples, reward_fn, sampling, ks=ks,
                                             environment=environment)
    finally:
        engine.close()
    report = {"checkpoint": str(checkpoint), "step": restored_step, "base_model": str(base),
              "task": getattr(task, "name", type(task).__name__), "temperature": temperature,
              "engine": type(engine).__name__, "quantization": engine.quantization,
              "seconds": time.perf_counter() - t0, **summary, "samples": records}
    if report_path is None:
        where = checkpoint if run is not None else Path.cwd()
        suffix = f"_step{restored_step}" if restored_step is not None else ""
        report_path = where / f"eval_{report['task']}{suffix}.json"
    Path(report_path).parent.mkdir(parents=True, exist_ok=True)
    Path(report_path).write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report))
    print(f"[evaluate] report: {report_path}")
    return report


def format_table(report: dict) -> str:
    keys = ["accuracy"] + sorted(k for k in report if k.startswith("pass@")) + ["mean_length", "mean_turns",
                                                                                  "num_problems", "samples_per_problem"]
    rows = [("checkpoint", report["checkpoint"]), ("step", report["step"]), ("task", report["task"]),
            ("engine", f"{report['engine']} ({report['quantization'] or 'bf16'})")]
    rows += [(k, f"{report[k]:.4f}" if isinstance(report[k], float) else report[k]) for k in keys]
    width = max(len(k) for k, _ in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * 50 + "+"
    body = [f"| {k:<{width}} | {str(v)[-48:]:<48} |" for k, v in rows]
    return "\n".join([line, *body, line])


def cli(argv=None):
    """Console entry point: parses --gin_file / --gin.NAME=VALUE flags and runs `evaluate`."""
    from portable_rl.engines.cpu_features import prefer_passive_omp_waits

    prefer_passive_omp_waits()  # before anything below imports torch
    from portable_rl import gin_utils

    gin_utils.register_library()  # rl.EnvironmentConfig: its bindings (gin/data/sql_generated.gin) build `environment`
    configured = gin_utils.register_configurable(
        gin_utils.with_config_defaults(evaluate, {"environment": gin_utils.CONFIG_OBJECTS["environment"]}),
        name="evaluate")
    gin_utils.run(configured, argv, description=__doc__.splitlines()[0], warn_traps=True)  # e.g. an unread TEMPERATURE


if __name__ == "__main__":
    cli()
