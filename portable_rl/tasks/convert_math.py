"""Published DAPO-Math-17k / AIME-2024 files → what `tasks.MathDatasetTask` reads (gin/data/dapo_math.gin).

    python -m portable_rl.tasks.convert_math --input dapo-math-17k.parquet --output data/dapo-math-17k.parquet
    python -m portable_rl.tasks.convert_math --input aime_2024_problems.parquet --output data/aime-2024.parquet

Inputs, as published on the Hugging Face hub (the layout is told by the columns):

  verl     BytedTsinghua-SIA/DAPO-Math-17k (data/dapo-math-17k.parquet), BytedTsinghua-SIA/AIME-2024
           (data/aime-2024.parquet): data_source, prompt [{role, content}], ability,
           reward_model {ground_truth, style}, extra_info {index}. The published files repeat their problems
           (DAPO-Math-17k: about 1.79 M rows of 17 917 distinct prompts), which would make a held-out set of
           copies and weight some training problems more than others.
  problem  Maxwell-Jia/AIME_2024 (aime_2024_problems.parquet): ID, Problem, Solution, Answer (an integer);
           lower-case problem / answer (HuggingFaceH4/aime_2024) too. The problem is wrapped in DAPO-Math's
           own instruction (`DAPO_INSTRUCTION`), so evaluation asks for the answer as training did.

Output: one row per distinct prompt, first occurrence first, in verl's layout (the file works in verl too):
data_source, prompt [{"role": "user", "content": ...}], ability, reward_model {ground_truth, style "rule"},
extra_info {index: the input row}. `.parquet` or `.jsonl` by the output's suffix. A repeat whose answer
differs from the first occurrence's is dropped too and counted in the summary line.

A malformed row (no prompt, a prompt that is not chat messages, an empty answer, ...) stops the conversion with
one line naming the row and what is wrong; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator

from portable_rl.errors import UserError

# DAPO-Math-17k's own prompt around each problem (the published rows carry it in their user message).
DAPO_INSTRUCTION = ("Solve the following math problem step by step. The last line of your response should be of the "
                    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
                    "Remember to put your answer on its own line after \"Answer:\".")
READ_BATCH_ROWS = 65536  # parquet rows turned into Python objects at a time (the 1.79 M-row file stays small)


class ConversionError(UserError, ValueError):
    """An input that is not a published DAPO-Math-17k / AIME-2024 file, or one of its rows is malformed."""


def _columns(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(path).names
    with path.open() as f:
        first = f.readline()
    try:
        return list(json.loads(first)) if first.strip() else []
    except (json.JSONDecodeError, TypeError):
        raise ConversionError(f"{path}: line 1 is not a JSON object; give a .parquet or .jsonl file") from None


def detect_layout(columns: list[str]) -> tuple[str, str, str]:
    """→ (layout, problem column, answer column) from the input's column names."""
    if "prompt" in columns and "reward_model" in columns:
        return "verl", "prompt", "reward_model"
    for problem, answer in (("Problem", "Answer"), ("problem", "answer")):
        if problem in columns and answer in columns:
            return "problem", problem, answer
    raise ConversionError(f"columns {columns} are neither verl's (prompt, reward_model: BytedTsinghua-SIA/"
                          "DAPO-Math-17k, BytedTsinghua-SIA/AIME-2024) nor Problem / Answer (Maxwell-Jia/AIME_2024); "
                          "download one of those files")


def read_rows(path: Path) -> Iterator[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=READ_BATCH_ROWS):
            yield from batch.to_pylist()
        return
    with path.open() as f:
        for n, line in enumerate(f):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConversionError(f"{path} row {n}: not JSON ({e})") from None


def _text(value) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return str(int(value)) if float(value).is_integer() else str(value)
    return value.strip() if isinstance(value, str) and value.strip() else None


def convert_row(row: dict, layout: str, problem_key: str, answer_key: str) -> tuple[str, str, dict]:
    """One input row → (prompt text, answer, output row); raises `ValueError` naming what is wrong."""
    if layout == "verl":
        messages = row.get(problem_key)
        if not (isinstance(messages, list) and messages
                and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)):
            raise ValueError(f"prompt is {type(messages).__name__}, not a list of chat messages {{role, content}}")
        users = [m["content"] for m in messages if m.get("role", "user") == "user"]
        prompt = _text(users[-1] if users else None)
        if prompt is None:
            raise ValueError("prompt has no user message with text")
        reward_model = row.get(answer_key)
        answer = _text(reward_model.get("ground_truth")) if isinstance(reward_model, dict) else None
        if answer is None:
            raise ValueError("reward_model.ground_truth is missing or empty")
        data_source, ability = row.get("data_source") or "math_dapo", row.get("ability") or "MATH"
    else:
        problem, answer = _text(row.get(problem_key)), _text(row.get(answer_key))
        if problem is None:
            raise ValueError(f"{problem_key} is missing or empty")
        if answer is None:
            raise ValueError(f"{answer_key} is missing or empty")
        prompt, data_source, ability = DAPO_INSTRUCTION.format(problem=problem), "aime_2024", "MATH"
    out = {"data_source": str(data_source), "prompt": [{"role": "user", "content": prompt}], "ability": str(ability),
           "reward_model": {"ground_truth": answer, "style": "rule"}}
    return prompt, answer, out


def convert(input_path: str | Path, output_path: str | Path) -> dict:
    """Converts one file (module doc); returns the counts that the summary line prints."""
    src, dst = Path(input_path), Path(output_path)
    if not src.is_file():
        raise FileNotFoundError(f"{src} is not a file; download it first (the module doc names the hub files)")
    if src.suffix not in (".parquet", ".jsonl") or dst.suffix not in (".parquet", ".jsonl"):
        raise ConversionError(f"convert {src} → {dst}: both must end in .parquet or .jsonl")
    layout, problem_key, answer_key = detect_layout(_columns(src))
    kept, answers, rows, conflicting = [], {}, 0, 0
    for index, row in enumerate(read_rows(src)):
        rows += 1
        try:
            if not isinstance(row, dict):
                raise ValueError(f"a {type(row).__name__}, not an object")
            prompt, answer, out = convert_row(row, layout, problem_key, answer_key)
        except ValueError as e:
            raise ConversionError(f"{src} row {index}: {e}; this is not the published {layout} layout: re-download "
                                  "the file, or drop or fix that row") from None
        if prompt in answers:
            conflicting += answers[prompt] != answer
            continue
        answers[prompt] = answer
        kept.append({**out, "extra_info": {"index": index}})
    if not kept:
        raise ConversionError(f"{src} has no rows; download the published file again")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.suffix == ".jsonl":
        dst.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(kept), dst)
    return {"layout": layout, "rows": rows, "kept": len(kept), "repeats": rows - len(kept),
            "repeats_with_another_answer": conflicting}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="the published .parquet (or .jsonl) file")
    parser.add_argument("--output", required=True, help="where the task's file goes (.parquet or .jsonl)")
    args = parser.parse_args(argv)
    try:
        counts = convert(args.input, args.output)
    except (UserError, FileNotFoundError) as e:
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None
    print(f"[convert_math] {args.input} ({counts['layout']} layout): {counts['rows']} rows → {counts['kept']} "
          f"distinct prompts ({counts['repeats']} repeats dropped, {counts['repeats_with_another_answer']} of them "
          f"with another answer) → {args.output}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
