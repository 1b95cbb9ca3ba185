"""A prompt/ground-truth dataset read from jsonl or parquet (the DAPO-Math-17k layout).

DAPO-Math-17k rows look like
    {"prompt": [{"role": "user", "content": "..."}], "reward_model": {"ground_truth": "34"}, ...}
so the default keys are `prompt_key="prompt"` and `answer_key="reward_model.ground_truth"` (a dotted
path into nested dicts). A prompt that is a list of chat messages becomes the text of its last user turn
(chat templates are the tokenizer's business, applied by the entry point).
Batches are drawn with `np.random.default_rng([seed, step, draw])`, so they depend only on the arguments.

Bad input: a missing file raises FileNotFoundError, an unreadable one (a directory, not jsonl/parquet,
corrupt parquet) raises `DatasetError`, both naming the fix. Malformed rows (invalid JSON, not an object,
prompt/answer missing, null or empty, a prompt that is neither text nor chat messages) are skipped and
counted by reason (`task.skipped_rows`, `task.skipped_reasons`, logged as `data/skipped_rows` through
`tasks.data_metrics`); a file with no usable row at all is a `DatasetError` (usually wrong prompt_key /
answer_key).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any


from portable_rl.errors import UserError
from portable_rl.tasks.base import DatasetTask, Example
from portable_rl.tasks.rewards import get_reward

_log = logging.getLogger(__name__)


class DatasetError(UserError, ValueError):
    """A dataset file that cannot be read, or that has no usable row."""


class _Skip(Exception):
    """A malformed row; `reason` is its counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


def _get(row: dict, dotted: str, missing: str) -> Any:
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise _Skip(missing, f"column {dotted!r} not found (row keys: {sorted(row)})")
        value = value[key]
    if value is None:
        raise _Skip(missing, f"column {dotted!r} is null")
    return value


def _prompt_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        users = [m["content"] for m in value if m.get("role", "user") == "user"]
        text = users[-1] if users else value[-1]["content"]
        if isinstance(text, str):
            return text
    raise _Skip("bad_prompt", f"a prompt of type {type(value).__name__}; expected text or chat messages")


def _example(row: Any, prompt_key: str, answer_key: str) -> Example:
    if not isinstance(row, dict):
        raise _Skip("not_an_object", f"a row of type {type(row).__name__}")
    prompt = _prompt_text(_get(row, prompt_key, "missing_prompt"))
    answer = str(_get(row, answer_key, "missing_answer"))
    if not prompt.strip():
        raise _Skip("empty_prompt")
    if not answer.strip():
        raise _Skip("empty_answer")
    return Example(prompt=prompt, answer=answer)


def _jsonl_rows(path: Path):
    """Yields a parsed row, or a `_Skip` for a line that is not JSON."""
    with path.open("rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield _Skip("invalid_json", str(e))


def _read_rows(path: Path) -> list:
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist; set the data path (e.g. --gin.DATA_PATH=...)")
    if path.is_dir():
        raise DatasetError(f"dataset {path} is a directory; point the data path at a .jsonl or .parquet file")
    if path.suffix not in (".jsonl", ".parquet"):
        raise DatasetError(f"unsupported dataset file {path}; use .jsonl or .parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        if path.suffix == ".jsonl":
            return list(_jsonl_rows(path))
        return pq.read_table(path).to_pylist()
    except (OSError, pa.ArrowException) as e:  # permissions, I/O errors, a corrupt or truncated parquet file
        raise DatasetError(f"cannot read dataset {path} ({' '.join(str(e).split())}); "
                           f"check the file, or re-export it as .jsonl / .parquet") from e


def read_dataset(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "reward_model.ground_truth",
                 limit: int | None = None) -> tuple[list[Example], collections.Counter]:
    """→ (examples of the usable rows, first `limit`; Counter of skipped rows by reason)."""
    path = Path(path)
    examples, skipped, first_problem = [], collections.Counter(), None
    for row in _read_rows(path):
        try:
            if isinstance(row, _Skip):
                raise row
            examples.append(_example(row, prompt_key, answer_key))
        except _Skip as skip:
            skipped[skip.reason] += 1
            first_problem = first_problem or f"{skip.reason}: {skip}"
    if not examples:
        raise DatasetError(f"no usable row in {path} ({sum(skipped.values())} skipped, first {first_problem}); "
                           f"set prompt_key / answer_key to the file's columns (now {prompt_key!r} / {answer_key!r})")
    if skipped:
        _log.warning("dataset %s: skipped %d of %d rows (%s)", path, sum(skipped.values()),
                     sum(skipped.values()) + len(examples), _reasons(skipped))
    return examples[:limit], skipped


def _reasons(skipped) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items()))


def read_examples(path: str | Path, *, prompt_key: str = "prompt",
                  answer_key: str = "reward_model.ground_truth", limit: int | None = None) -> list[Example]:
    """The usable rows of `path` as examples (malformed rows skipped; see `read_dataset` for the counts)."""
    return read_dataset(path, prompt_key=prompt_key, answer_key=answer_key, limit=limit)[0]


@dataclasses.dataclass
class MathDatasetTask(DatasetTask):
    """Prompts and ground-truth answers read from a .jsonl or .parquet file (module doc: layout, bad rows).

    Attributes:
      train_path: the training file (.jsonl or .parquet); batches are drawn from its usable rows.
      eval_path: the held-out file, its first num_eval usable rows; None: hold out the last num_eval rows of
        train_path (then not trained on).
      prompt_key: the prompt's column, a dotted path into nested objects; the value is text or chat messages
        (the last user turn is used).
      answer_key: the ground truth's column, a dotted path into nested objects.
      num_eval: held-out examples.
      prompt_template: a str.format template wrapping each prompt as {prompt} (double any other brace), e.g.
        "{prompt}\\nPut the final answer in \\\\boxed{{}}." (as written in a gin file).
      seed: the seed of the training batches (rows drawn without replacement within a batch, unless the
        batch is larger than the file).
      reward: the registered reward that scores a response (`tasks.rewards`: "math_verify", "exact_match",
        "final_number").
      name: the task's name in evaluation reports (and their default file name).
    """
    train_path: str
    eval_path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    num_eval: int = 200
    prompt_template: str = "{prompt}"
    seed: int = 0
    reward: str = "math_verify"
    name: str = "math_dataset"

    def __post_init__(self):
        get_reward(self.reward)  # an unknown reward name fails here, before any model is loaded
        try:
            self.prompt_template.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise DatasetError(f"prompt_template={self.prompt_template!r} does not format ({e!r}); write the "
                               f"prompt as {{prompt}} and double any other brace") from None
        keys = dict(prompt_key=self.prompt_key, answer_key=self.answer_key)
        train, skipped = read_dataset(self.train_path, **keys)
        if self.eval_path:
            held_out, eval_skipped = read_dataset(self.eval_path, **keys)
            self._train, self._eval = train, held_out[: self.num_eval]
            skipped = skipped + eval_skipped
        else:
            if len(train) <= self.num_eval:
                raise DatasetError(f"{self.train_path} has {len(train)} usable rows, not more than num_eval="
                                   f"{self.num_eval}; lower num_eval or pass eval_path")
            self._train, self._eval = train[: -self.num_eval], train[-self.num_eval:]
        self.skipped_reasons = dict(sorted(skipped.items()))   # reason -> malformed rows skipped (both files)
        self.skipped_rows = sum(skipped.values())
        self._train = [self._templated(e) for e in self._train]
        self._eval = [self._templated(e) for e in self._eval]

    def _templated(self, e: Example) -> Example:
        return Example(prompt=self.prompt_template.format(prompt=e.prompt), answer=e.answer)
