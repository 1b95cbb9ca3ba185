"""The one encode → generate → decode → reward path (rl/scoring.py) that training and evaluation share."""

import numpy as np
import pytest

from portable_rl.engines.base import EngineAdapter, Rollout, SamplingConfig
from portable_rl.rl.codec import TextCodec
from portable_rl.rl.dapo import dapo_config
from portable_rl.rl.evaluation import evaluate_examples
from portable_rl.rl.rollout import collect_groups
from portable_rl.rl.scoring import generate_and_score
from portable_rl.tasks import ArithmeticTask, get_reward
from portable_rl.convert.tiny_checkpoint import char_tokenizer


class AnswerKeyEngine(EngineAdapter):
    """Stands in for a sampler with a known answer key: sample j of a prompt answers it right iff j is even
    (the prompt's answer is looked up from its token ids), then emits EOS; logprobs -0.1 per token."""

    def __init__(self, codec, answers):
        self.codec, self.answers = codec, answers     # prompt token ids (tuple) → answer text

    def generate(self, prompt_token_ids, sampling):
        out = []
        for i, p in enumerate(prompt_token_ids):
            for j in range(sampling.n):
                text = self.answers[tuple(p)] if j % 2 == 0 else "x"
                ids = self.codec.encode_response(text)
                out.append(Rollout(i, list(p), ids, [-0.1] * len(ids), "stop"))
        return out

    def update_weights(self, named_tensors):
        pass

    def close(self):
        pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer_dir = tmp_path_factory.mktemp("scoring")
    char_tokenizer().save_pretrained(tokenizer_dir)
    codec = TextCodec(tokenizer_dir)
    task = ArithmeticTask(num_digits=2, num_eval=20, seed=3)
    examples = task.train_batch(0, 0, 6) + task.eval_examples()[:6]
    engine = AnswerKeyEngine(codec, {tuple(codec.encode_prompt(e.prompt)): e.answer for e in examples})
    return codec, task, engine


def test_generate_and_score_is_prompt_major_and_scores_each_sample_against_its_prompt(setup):
    codec, task, engine = setup
    examples = task.train_batch(0, 0, 6)
    scored = generate_and_score(engine, codec, examples, get_reward("exact_match"), SamplingConfig(n=4))
    assert [r.prompt_index for r in scored.rollouts] == [p for p in range(6) for _ in range(4)]
    assert scored.texts == [examples[p].answer if j % 2 == 0 else "x" for p in range(6) for j in range(4)]
    np.testing.assert_array_equal(scored.rewards, np.float32([1, 0, 1, 0] * 6))
    assert scored.rewards.dtype == np.float32 and scored.scores == [1.0, 0.0, 1.0, 0.0] * 6


def test_training_and_evaluation_see_the_same_scores(setup):
    codec, task, engine = setup
    reward = get_reward("exact_match")
    cfg = dapo_config(prompt_batch_size=6, mini_batch_size=6, n_samples=4, max_gen_batches=1)
    groups, stats = collect_groups(engine, codec, task, reward, cfg, step=0, seed=0)
    assert len(groups) == 6 and stats["reward/mean"] == 0.5 and stats["accuracy/train"] == 0.5
    for g in groups:   # each group holds its own example's 4 samples
        np.testing.assert_array_equal(g.rewards, np.float32([1, 0, 1, 0]))
        assert codec.decode_response(g.rollouts[0].response_token_ids) == g.example.answer
    summary, records = evaluate_examples(engine, codec, task.eval_examples()[:6], reward, SamplingConfig(n=2),
                                         ks=(1, 2), batch_size=4)
    assert summary["accuracy"] == 0.5 and summary["pass@2"] == 1.0 and len(records) == 12
    assert [r["reward"] for r in records] == [1.0, 0.0] * 6
    assert all(r["response"] == r["answer"] for r in records[::2])
