"""`python -m portable_rl.tasks.convert_math` on small files written in the published hub schemas: the output is
what gin/data/dapo_math.gin's `MathDatasetTask` reads, repeats are dropped, a malformed row is one line."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from portable_rl.tasks import MathDatasetTask, read_dataset
from portable_rl.tasks.convert_math import DAPO_INSTRUCTION, main

# BytedTsinghua-SIA/DAPO-Math-17k and BytedTsinghua-SIA/AIME-2024 (verl's layout), as the hub's dataset card types it
VERL_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string())])),
])
# Maxwell-Jia/AIME_2024's aime_2024_problems.parquet
PROBLEM_SCHEMA = pa.schema([("ID", pa.string()), ("Problem", pa.string()), ("Solution", pa.string()),
                            ("Answer", pa.int64())])


def _dapo_row(problem, answer, index):
    return {"data_source": "math_dapo", "ability": "MATH", "extra_info": {"index": index},
            "prompt": [{"content": DAPO_INSTRUCTION.format(problem=problem), "role": "user"}],
            "reward_model": {"ground_truth": answer, "style": "rule"}}


def _write(path, rows, schema):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def test_dapo_and_aime_files_become_the_math_tasks_input(tmp_path, capsys):
    problems = [("What is 2+3?", "5"), ("Find x if 2x = 8.", "4"), ("Compute 7*6.", "42")]
    # the published file repeats every problem (here 3 times, interleaved, as the hub's copy does)
    rows = [_dapo_row(p, a, f"id-{i}") for _ in range(3) for i, (p, a) in enumerate(problems)]
    rows.append(_dapo_row(problems[0][0], "6", "id-0"))  # a repeat with another answer: the first one wins
    dapo = _write(tmp_path / "dapo-math-17k.parquet", rows, VERL_SCHEMA)
    aime = _write(tmp_path / "aime_2024_problems.parquet", [
        {"ID": "2024-I-1", "Problem": "Every morning Aya walks $9$ km. Find $t$.", "Solution": "...", "Answer": 204},
        {"ID": "2024-I-2", "Problem": "Find $xy$.", "Solution": "...", "Answer": 25}], PROBLEM_SCHEMA)

    main(["--input", str(dapo), "--output", str(tmp_path / "out" / "train.parquet")])
    main(["--input", str(aime), "--output", str(tmp_path / "out" / "aime.jsonl")])
    out = capsys.readouterr().out.splitlines()
    assert "(verl layout): 10 rows → 3 distinct prompts (7 repeats dropped, 1 of them with another answer)" in out[0]
    assert "(problem layout): 2 rows → 2 distinct prompts (0 repeats dropped" in out[1]

    train, skipped = read_dataset(tmp_path / "out" / "train.parquet")
    assert not skipped
    assert [(e.prompt, e.answer) for e in train] == [(DAPO_INSTRUCTION.format(problem=p), a) for p, a in problems]
    held_out, skipped = read_dataset(tmp_path / "out" / "aime.jsonl")
    assert not skipped and [e.answer for e in held_out] == ["204", "25"]
    assert held_out[0].prompt == DAPO_INSTRUCTION.format(problem="Every morning Aya walks $9$ km. Find $t$.")
    # verl's layout on the way out too: the file also works in verl
    first = json.loads((tmp_path / "out" / "aime.jsonl").read_text().splitlines()[0])
    assert set(first) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert first["reward_model"] == {"ground_truth": "204", "style": "rule"} and first["extra_info"] == {"index": 0}

    # what gin/data/dapo_math.gin builds from the two files
    task = MathDatasetTask(train_path=str(tmp_path / "out" / "train.parquet"),
                           eval_path=str(tmp_path / "out" / "aime.jsonl"), num_eval=30)
    assert len(task.eval_examples()) == 2 and task.skipped_rows == 0


@pytest.mark.parametrize("schema, rows, message", [
    (VERL_SCHEMA, [_dapo_row("What is 2+3?", "5", "a"), _dapo_row("Compute 7*6.", None, "b")],
     "row 1: reward_model.ground_truth is missing or empty; this is not the published verl layout"),
    (PROBLEM_SCHEMA, [{"ID": "2024-I-1", "Problem": None, "Solution": "", "Answer": 3}],
     "row 0: Problem is missing or empty; this is not the published problem layout"),
    (pa.schema([("question", pa.string()), ("solution", pa.string())]), [{"question": "q", "solution": "s"}],
     "are neither verl's (prompt, reward_model"),
])
def test_a_malformed_file_is_one_line_and_writes_nothing(tmp_path, schema, rows, message):
    src = _write(tmp_path / "in.parquet", rows, schema)
    with pytest.raises(SystemExit) as e:
        main(["--input", str(src), "--output", str(tmp_path / "out.parquet")])
    text = str(e.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text, text
    assert not (tmp_path / "out.parquet").exists()
