"""Tasks are deterministic from (seed, step, draw), keep held-out problems out of training, and
rewards score real model-like output correctly."""

import json

import pytest

from portable_rl.tasks import (ArithmeticTask, DatasetError, MathDatasetTask, UnknownRewardError,
                               available_rewards, data_metrics, get_reward, read_examples, register_reward)


def test_arithmetic_is_deterministic_and_seed_dependent():
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert a.train_batch(7, 1, 16) == b.train_batch(7, 1, 16)
    assert a.eval_examples() == b.eval_examples()
    assert a.train_batch(7, 1, 16) != a.train_batch(7, 2, 16)
    assert a.train_batch(7, 0, 16) != ArithmeticTask(seed=4).train_batch(7, 0, 16)


def test_arithmetic_answers_are_correct_and_difficulty_knob_sets_digits():
    task = ArithmeticTask(num_digits=3, ops="+-*", seed=0)
    for ex in task.train_batch(0, 0, 64) + task.eval_examples():
        assert ex.prompt.endswith("=")
        assert eval(ex.prompt[:-1]) == int(ex.answer)
        operands = [s for s in ex.prompt[:-1].replace("-", "+").replace("*", "+").split("+") if s]
        assert all(len(o) <= 3 for o in operands)
    assert any(len(ex.answer) >= 5 for ex in task.train_batch(0, 0, 64))  # 3-digit products


def test_arithmetic_held_out_never_in_training():
    task = ArithmeticTask(num_digits=1, seed=0, num_eval=20)  # 100 problems: collisions are likely
    held = {e.prompt for e in task.eval_examples()}
    assert len(held) == 20
    for step in range(20):
        assert not held & {e.prompt for e in task.train_batch(step, 0, 32)}


def test_arithmetic_bad_config_errors():
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="/")
    with pytest.raises(ValueError, match="num_eval"):
        ArithmeticTask(num_digits=1, num_eval=1000)


def _dapo_rows(n):
    return [{"data_source": "math_dapo",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule"}}
            for i in range(n)]


def test_math_dataset_reads_jsonl_and_parquet_in_dapo_layout(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _dapo_rows(30)
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    a, b = read_examples(jl), read_examples(tmp_path / "d.parquet")
    assert a == b and a[3].prompt == "What is 3 + 3?" and a[3].answer == "6"

    task = MathDatasetTask(train_path=str(jl), num_eval=5, prompt_template="{prompt} Box it.")
    assert [e.answer for e in task.eval_examples()] == [str(2 * i) for i in range(25, 30)]
    batch = task.train_batch(2, 0, 8)
    assert batch == task.train_batch(2, 0, 8) and all(e.prompt.endswith("Box it.") for e in batch)
    assert not {e.prompt for e in task.eval_examples()} & {e.prompt for e in task.train_batch(0, 0, 25)}


def test_math_dataset_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="data path"):
        read_examples(tmp_path / "missing.jsonl")
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "1+1", "answer": "2"}))
    with pytest.raises(DatasetError, match="no usable row.*'question'.*set prompt_key / answer_key"):
        read_examples(p)  # every row lacks the configured column: a config error, not skipped rows
    assert read_examples(p, prompt_key="question", answer_key="answer")[0].answer == "2"
    with pytest.raises(DatasetError, match="num_eval"):
        MathDatasetTask(train_path=str(p), prompt_key="question", answer_key="answer", num_eval=5)
    with pytest.raises(DatasetError, match="prompt_template"):
        MathDatasetTask(train_path=str(p), prompt_key="question", answer_key="answer", num_eval=0,
                        prompt_template="{question} Box it.")
    with pytest.raises(UnknownRewardError, match="unknown reward 'nope'.*exact_match"):
        MathDatasetTask(train_path=str(p), prompt_key="question", answer_key="answer", num_eval=0, reward="nope")


def test_math_dataset_skips_and_counts_malformed_rows(tmp_path):
    good = _dapo_rows(12)
    bad = ["{not json", json.dumps([1, 2]), json.dumps({"prompt": "no answer"}),
           json.dumps({"prompt": None, "reward_model": {"ground_truth": "1"}}),
           json.dumps({"prompt": "  ", "reward_model": {"ground_truth": "1"}}),
           json.dumps({"prompt": "q", "reward_model": {"ground_truth": ""}}),
           json.dumps({"prompt": 17, "reward_model": {"ground_truth": "1"}})]
    lines = [json.dumps(r) for r in good]
    lines[3:3] = bad  # malformed rows in the middle of the file
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n\n")
    task = MathDatasetTask(train_path=str(p), num_eval=2, reward="exact_match")
    assert task.skipped_rows == len(bad)
    assert task.skipped_reasons == {"bad_prompt": 1, "empty_answer": 1, "empty_prompt": 1, "invalid_json": 1,
                                    "missing_answer": 1, "missing_prompt": 1, "not_an_object": 1}
    assert [e.answer for e in task.eval_examples()] == ["20", "22"]  # the good rows, in order
    assert len({e.prompt for e in task.train_batch(0, 0, 64)}) == 10
    metrics = data_metrics(task)
    assert metrics["data/skipped_rows"] == 7 and metrics["data/skipped/invalid_json"] == 1
    assert data_metrics(ArithmeticTask()) == {}


def test_rewards_registry_and_scoring():
    assert {"exact_match", "math_verify"} <= set(available_rewards())
    em = get_reward("exact_match")
    assert em(" 85", "85") == 1.0 and em("58", "85") == 0.0 and em("", "85") == 0.0
    mv = get_reward("math_verify")
    assert mv("so the answer is \\boxed{34}", "34") == 1.0
    assert mv("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert mv("\\boxed{35}", "34") == 0.0
    assert mv("no idea", "34") == 0.0
    with pytest.raises(KeyError, match="unknown reward 'nope'; set the task's reward to one of exact_match"):
        get_reward("nope")
    with pytest.raises(UnknownRewardError, match="math_verify"):
        ArithmeticTask(reward="exact")
    with pytest.raises(ValueError, match="already"):
        register_reward("exact_match")(lambda r, a: 0.0)
