"""WordProblemsTask: deterministic, held-out set disjoint from training draws, answers that follow from
the text; the `final_number` reward parser."""

import re

import pytest

from portable_rl.tasks import WordProblemsTask, final_number, get_reward


# The phrasings that remove from the quantity; every other change sentence adds to it.
_REMOVES = re.compile(r"gives \d+ \w+ to|loses|sells|trades away|customers buy|each buy|sent to|get off|borrow|"
                      r"removes|spends|dollars for|tickets|run away")


def _solve(prompt: str) -> int:
    """Recomputes a problem's answer from its text alone (independent of the generator's bookkeeping):
    the first sentence's number, then ± each change sentence's number (or product of its two numbers)."""
    story = prompt.split("\n")[0]
    sentences = re.split(r"(?<=[.?])\s+", story)
    total = int(re.search(r"\d+", sentences[0]).group())
    for s in sentences[1:-1]:
        nums = [int(x) for x in re.findall(r"\d+", s)]
        assert len(nums) in (1, 2), s
        amount = nums[0] * nums[-1] if len(nums) == 2 else nums[0]
        total += -amount if _REMOVES.search(s.lower()) else amount
        assert total >= 0, prompt
    return total


@pytest.mark.parametrize("grouped", [False, True])
def test_answers_follow_from_the_text(grouped):
    task = WordProblemsTask(grouped=grouped, num_eval=300, seed=3)
    problems = task.eval_examples() + task.train_batch(step=0, draw=0, batch_size=300)
    for ex in problems:
        assert int(ex.answer) >= 0
        assert _solve(ex.prompt) == int(ex.answer), ex.prompt
        assert ex.prompt.endswith(task.instruction)
    # each problem has between min_ops and max_ops change sentences (start + changes + question)
    story_lengths = {len(re.split(r"(?<=[.?])\s+", ex.prompt.split("\n")[0])) for ex in problems}
    assert story_lengths == {task.min_ops + 2, task.max_ops + 2}


def test_grouped_problems_contain_products():
    plain = WordProblemsTask(num_eval=200)
    grouped = WordProblemsTask(num_eval=200, grouped=True)
    assert not any(" each" in e.prompt.split("\n")[0] for e in plain.eval_examples())
    assert sum(" each" in e.prompt.split("\n")[0] for e in grouped.eval_examples()) > 50


def test_deterministic_from_seed_and_step():
    a, b = WordProblemsTask(seed=1), WordProblemsTask(seed=1)
    assert a.eval_examples() == b.eval_examples()
    assert a.train_batch(5, 1, 16) == b.train_batch(5, 1, 16)
    assert a.train_batch(5, 1, 16) != a.train_batch(6, 1, 16)
    assert a.train_batch(5, 0, 16) != a.train_batch(5, 1, 16)
    assert WordProblemsTask(seed=2).eval_examples() != a.eval_examples()


def test_held_out_set_is_unique_and_disjoint_from_training_draws():
    task = WordProblemsTask(num_eval=128, min_ops=1, max_ops=1, max_start=5, max_amount=1)  # a small space
    held_out = {e.prompt for e in task.eval_examples()}
    assert len(held_out) == 128
    trained = {e.prompt for step in range(40) for e in task.train_batch(step, 0, 32)}
    assert trained and not held_out & trained
    # the small space makes collisions certain, so the exclusion is what keeps them apart
    assert len(trained) < 40 * 32


def test_varied_templates():
    prompts = [e.prompt for e in WordProblemsTask(num_eval=200).eval_examples()]
    openings = {p.split(" has ")[0] if " has " in p else p.split(" holds ")[0] for p in prompts}
    assert len(openings) > 10
    assert {"bus", "shop", "shelf", "dollars", "farmer"} <= {w for p in prompts for w in
                                                             re.findall(r"[a-z]+", p)}


@pytest.mark.parametrize("bad, match", [(dict(min_ops=0), "min_ops"), (dict(min_ops=3, max_ops=2), "min_ops"),
                                        (dict(max_start=4), "max_start"), (dict(max_amount=0), "max_amount"),
                                        (dict(reward="nope"), "unknown reward")])
def test_bad_settings_name_the_fix(bad, match):
    with pytest.raises((ValueError, KeyError), match=match):
        WordProblemsTask(**bad)


@pytest.mark.parametrize("response, value", [
    ("12 + 7 = 19, 19 - 5 = 14.\n#### 14", 14.0),
    ("#### 14\nSo the answer is 20.", 14.0),            # '####' wins over later numbers
    ("First 12 + 7 = 19. Then 19 - 5 = 14. The answer is 14.", 14.0),  # no '####': the last number
    ("He has 1,234 apples.", 1234.0),
    ("#### $1,234.", 1234.0),
    ("The answer is 14.0", 14.0),
    ("3 - 5 gives -2", -2.0),
    ("#### 5 #### 7", 7.0),                              # the last '####'
    ("no numbers here", None),
    ("12 apples, then ####", None),                       # '####' with nothing after it: no answer
])
def test_final_number(response, value):
    assert final_number(response) == value


def test_final_number_reward():
    reward = get_reward("final_number")
    assert reward("19 - 5 = 14\n#### 14", "14") == 1.0
    assert reward("The answer is 14.", "14") == 1.0
    assert reward("#### 15", "14") == 0.0
    assert reward("14 apples, so #### 41", "14") == 0.0
    assert reward("I don't know", "14") == 0.0
    assert WordProblemsTask().reward == "final_number"
