"""Multi-step arithmetic word problems, generated deterministically from a seed (for instruct models).

A problem is a scene (a person's apples, a shop's stock, a bus's passengers, ...) with a starting
quantity q_0 and `num_ops` ∈ [min_ops, max_ops] changes, each one sentence:

    q_j = q_{j-1} + k            ("buys 7 more")           k ∈ [1, max_amount]
    q_j = q_{j-1} − k            ("gives 5 to Ben")        k ≤ q_{j-1}, so every q_j ≥ 0
    q_j = q_{j-1} ± k · m        ("buys 3 bags of 4")      only with `grouped=True`, k ∈ [2, 5], m ∈ [2, 9]

    answer = q_{num_ops}  (a non-negative integer, as text)

e.g. "Sam has 12 apples. Then he buys 7 more apples. After that, he gives 5 apples to Mia. How many
apples does Sam have now?" + `instruction` (reason step by step, final answer after "####") → "14".

Reward `final_number` (registered here): the first number after the last "####" in the response, else
the last number anywhere in it; 1.0 when it equals the answer, else 0.0 ("1,234" and "14.0" parse).

Held-out set: drawn first from its own rng stream, unique prompts; training draws skip those prompts,
so held-out accuracy measures generalisation. Training batch (step, draw) comes from
`np.random.default_rng([seed, step, draw])` (resumable: no iterator state).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from portable_rl.errors import ConfigError
from portable_rl.tasks.base import Example, GeneratedTask
from portable_rl.tasks.rewards import get_reward, register_reward

_EVAL_STREAM = 2**31 - 2  # rng stream id of the held-out set (train streams use step >= 0)

_PEOPLE = (("Sam", "he"), ("Mia", "she"), ("Ben", "he"), ("Lena", "she"), ("Omar", "he"), ("Ava", "she"),
           ("Leo", "he"), ("Zoe", "she"), ("Raj", "he"), ("Nora", "she"), ("Tom", "he"), ("Emma", "she"),
           ("Ivan", "he"), ("Lucy", "she"), ("Kofi", "he"), ("Maya", "she"))
_CONNECTORS = ("Then", "After that,", "Later,", "Next,")


@dataclasses.dataclass(frozen=True)
class _Scene:
    start: str            # "{name} has {a} {unit}."
    question: str         # "How many {unit} does {name} have now?"
    units: tuple          # what is counted, e.g. ("apples", "marbles")
    add: tuple            # clauses adding {k}: "{s} buys {k} more {unit}"
    sub: tuple            # clauses removing {k}
    add_grouped: tuple    # clauses adding {k} groups of {m}
    sub_grouped: tuple    # clauses removing {k} groups of {m}
    person: bool = True   # the subject {s} is a person (name first, then the pronoun)


_SCENES = (
    _Scene("{name} has {a} {unit}.", "How many {unit} does {name} have now?",
           ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards"),
           ("{s} buys {k} more {unit}", "{s} finds {k} more {unit}", "{friend} gives {obj} {k} {unit}",
            "{s} wins {k} {unit} in a game"),
           ("{s} gives {k} {unit} to {friend}", "{s} loses {k} {unit}", "{s} sells {k} {unit}",
            "{s} trades away {k} {unit}"),
           ("{s} buys {k} packs with {m} {unit} in each pack", "{friend} gives {obj} {k} bags of {m} {unit} each"),
           ("{s} gives {m} {unit} to each of {k} friends", "{s} sells {k} boxes of {m} {unit} each")),
    _Scene("A shop has {a} {unit} in stock.", "How many {unit} does the shop have now?",
           ("lamps", "chairs", "umbrellas", "backpacks", "kettles", "jackets"),
           ("a delivery brings {k} more {unit}", "the owner orders {k} more {unit}",
            "a customer returns {k} {unit}"),
           ("customers buy {k} {unit}", "the shop sells {k} {unit}", "{k} {unit} are sent to another store"),
           ("{k} crates arrive with {m} {unit} in each crate",),
           ("{k} customers each buy {m} {unit}",), person=False),
    _Scene("A bus has {a} {unit} on board.", "How many {unit} are on the bus now?", ("passengers",),
           ("at the next stop, {k} {unit} get on", "{k} more {unit} get on"),
           ("at the next stop, {k} {unit} get off", "{k} {unit} get off"),
           ("{k} families of {m} get on",), ("{k} groups of {m} {unit} get off",), person=False),
    _Scene("A library shelf holds {a} {unit}.", "How many {unit} are on the shelf now?", ("books",),
           ("readers return {k} {unit}", "the librarian adds {k} new {unit}"),
           ("readers borrow {k} {unit}", "the librarian removes {k} old {unit}"),
           ("{k} boxes of {m} donated {unit} are added",), ("{k} classes borrow {m} {unit} each",),
           person=False),
    _Scene("{name} has {a} dollars.", "How many dollars does {name} have now?", ("dollars",),
           ("{s} earns {k} dollars", "{friend} pays {obj} {k} dollars", "{s} finds {k} dollars"),
           ("{s} spends {k} dollars on lunch", "{s} pays {k} dollars for a book",
            "{s} gives {k} dollars to {friend}"),
           ("{s} works {k} hours and earns {m} dollars each hour",),
           ("{s} buys {k} tickets that cost {m} dollars each",)),
    _Scene("A farmer has {a} {unit}.", "How many {unit} does the farmer have now?",
           ("chickens", "goats", "sheep", "ducks"),
           ("the farmer buys {k} more {unit}", "{k} young {unit} are born"),
           ("the farmer sells {k} {unit}", "{k} {unit} run away"),
           ("the farmer buys {k} pens with {m} {unit} in each",),
           ("the farmer sells {k} groups of {m} {unit}",), person=False),
)


@dataclasses.dataclass
class WordProblemsTask(GeneratedTask):
    """Multi-step word problems with a non-negative integer answer (module doc: the generator, the reward).

    Attributes:
      min_ops: the fewest changes per problem; the count is uniform in [min_ops, max_ops] (1 <= min_ops).
      max_ops: the most changes per problem (>= min_ops).
      max_start: the starting quantity q_0 is uniform in [5, max_start] (>= 5).
      max_amount: a single change k is uniform in [1, max_amount] (>= 1).
      grouped: also draw "k groups of m" changes (k in [2, 5], m in [2, 9]: a product inside a step).
      instruction: text appended on a new line after the question (how to reason and mark the answer).
      seed: the seed of the held-out set and of every training batch.
      num_eval: held-out problems (>= 0); training never draws their prompts.
      reward: the registered reward that scores a response (`tasks.rewards`; "final_number": the number
        after the last "####").
      name: the task's name in evaluation reports (and their default file name).
    """
    min_ops: int = 2
    max_ops: int = 3
    max_start: int = 30
    max_amount: int = 12
    grouped: bool = False
    instruction: str = ("Think step by step, then write the final answer as a single number "
                        "after '####'.")
    seed: int = 0
    num_eval: int = 128
    reward: str = "final_number"
    name: str = "word_problems"

    def __post_init__(self):
        get_reward(self.reward)  # an unknown reward name fails here, before any model is loaded
        if not 1 <= self.min_ops <= self.max_ops:
            raise ConfigError(f"min_ops={self.min_ops}, max_ops={self.max_ops}: need 1 <= min_ops <= max_ops")
        if self.max_start < 5:
            raise ConfigError(f"max_start={self.max_start} must be >= 5 (the smallest starting quantity)")
        if self.max_amount < 1:
            raise ConfigError(f"max_amount={self.max_amount} must be >= 1")
        if self.num_eval < 0:
            raise ConfigError(f"num_eval={self.num_eval} must be >= 0")
        self._init_held_out(self.seed, _EVAL_STREAM, self.num_eval)

    def _problem(self, rng: np.random.Generator) -> Example:
        def pick(options):
            return options[int(rng.integers(0, len(options)))]

        scene = pick(_SCENES)
        (name, pron), (friend, _) = (_PEOPLE[i] for i in rng.choice(len(_PEOPLE), size=2, replace=False))
        unit = pick(scene.units)
        fields = dict(name=name, friend=friend, unit=unit, obj="him" if pron == "he" else "her")
        total = int(rng.integers(5, self.max_start + 1))
        sentences = [scene.start.format(a=total, **fields)]
        for j in range(int(rng.integers(self.min_ops, self.max_ops + 1))):
            kind = "add" if total == 0 or rng.random() < 0.5 else "sub"
            k, m = int(rng.integers(1, self.max_amount + 1)), 1
            clauses = scene.add if kind == "add" else scene.sub
            if self.grouped and rng.random() < 0.4:
                k, m = int(rng.integers(2, 6)), int(rng.integers(2, 10))
                if kind == "add" or k * m <= total:
                    clauses = scene.add_grouped if kind == "add" else scene.sub_grouped
                else:
                    k, m = int(rng.integers(1, total + 1)), 1  # the group does not fit: a single removal
            if kind == "sub":
                k = min(k, total // m)
            total += k * m if kind == "add" else -k * m
            subject = name if j == 0 else pron
            clause = pick(clauses).format(s=subject, k=k, m=m, **fields)
            sentence = clause if j == 0 else f"{pick(_CONNECTORS)} {clause}"
            sentences.append(sentence[0].upper() + sentence[1:] + ".")
        sentences.append(scene.question.format(**fields))
        return Example(prompt=" ".join(sentences) + "\n" + self.instruction, answer=str(total))


# A number: "1,234" (thousands separators), "14", "14.5", "-3" (sign only when attached).
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def final_number(response: str) -> float | None:
    """The first number after the last '####', else the last number in `response`; None if none."""
    if "####" in response:
        found = _NUMBER.findall(response.rsplit("####", 1)[1])
        text = found[0] if found else None
    else:
        found = _NUMBER.findall(response)
        text = found[-1] if found else None
    return None if text is None else float(text.replace(",", ""))


@register_reward("final_number")
def final_number_reward(response: str, answer: str) -> float:
    value = final_number(response)
    return float(value is not None and value == float(answer))
