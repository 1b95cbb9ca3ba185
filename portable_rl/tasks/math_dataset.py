"""A prompt/ground-truth dataset read from jsonl or parquet (the DAPO-Math-17k layout).

DAPO-Math-17k rows look like
    {"prompt": [{"role": "user", "content": "..."}], "reward_model": {"ground_truth": "34"}, ...}
so the default keys are `prompt_key="prompt"` and `answer_key="reward_model.ground_truth"` (a dotted
path into nested dicts). A prompt that is a list of chat messages becomes the text of its last user turn
(chat templates are the tokenizer's business, applied by the entry point).
Batches are drawn with `np.random.default_rng([seed, step, draw])`, so they depend only on the arguments.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from portable_rl.tasks.base import Example


def _get(row: dict, dotted: str) -> Any:
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise KeyError(f"column {dotted!r} not found (row keys: {sorted(row)}); set prompt_key/answer_key")
        value = value[key]
    return value


def _prompt_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if isinstance(value, list) and value and isinstance(value[-1], dict) and "content" in value[-1]:
        users = [m["content"] for m in value if m.get("role", "user") == "user"]
        return users[-1] if users else value[-1]["content"]
    raise ValueError(f"cannot read a prompt from {type(value).__name__}; expected text or chat messages")


def _read_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    raise ValueError(f"unsupported dataset file {path}; use .jsonl or .parquet")


def read_examples(path: str | Path, *, prompt_key: str = "prompt",
                  answer_key: str = "reward_model.ground_truth", limit: int | None = None) -> list[Example]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist; set the data path (e.g. --gin.DATA_PATH=...)")
    rows = _read_rows(path)[:limit]
    return [Example(prompt=_prompt_text(_get(r, prompt_key)), answer=str(_get(r, answer_key))) for r in rows]


@dataclasses.dataclass
class MathDatasetTask:
    train_path: str
    eval_path: str | None = None   # None: hold out the last `num_eval` training rows
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    num_eval: int = 200
    prompt_template: str = "{prompt}"  # e.g. "{prompt}\nPut the final answer in \\boxed{{}}."
    seed: int = 0
    reward: str = "math_verify"
    name: str = "math_dataset"

    def __post_init__(self):
        keys = dict(prompt_key=self.prompt_key, answer_key=self.answer_key)
        train = read_examples(self.train_path, **keys)
        if self.eval_path:
            self._train, self._eval = train, read_examples(self.eval_path, **keys)[: self.num_eval]
        else:
            if len(train) <= self.num_eval:
                raise ValueError(f"{self.train_path} has {len(train)} rows, not more than num_eval="
                                 f"{self.num_eval}; lower num_eval or pass eval_path")
            self._train, self._eval = train[: -self.num_eval], train[-self.num_eval:]
        self._train = [self._templated(e) for e in self._train]
        self._eval = [self._templated(e) for e in self._eval]

    def _templated(self, e: Example) -> Example:
        return Example(prompt=self.prompt_template.format(prompt=e.prompt), answer=e.answer)

    def train_batch(self, step: int, draw: int, batch_size: int) -> list[Example]:
        rng = np.random.default_rng([self.seed, step, draw])
        idx = rng.choice(len(self._train), size=batch_size, replace=batch_size > len(self._train))
        return [self._train[i] for i in idx]

    def eval_examples(self) -> list[Example]:
        return list(self._eval)
