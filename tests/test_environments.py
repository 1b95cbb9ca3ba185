"""The environment contract (portable_rl/environments) and the multi-turn driver (rl/turns.py): a calculator
tool environment driven by the real driver, codec, batching, wire and rollout correction; the engine is a
scripted sampler (the real-vLLM check is tests/test_environments_vllm.py)."""

import dataclasses
import time

import numpy as np
import pytest

from portable_rl import tis
from portable_rl.engines.base import EngineAdapter, Rollout, SamplingConfig, prompt_seeds
from portable_rl.errors import ConfigError
from portable_rl.environments import (Environment, SingleTurnEnvironment, Step, UnknownEnvironmentError,
                                      available_environments, get_environment, register_environment)
from portable_rl.rl import batching
from portable_rl.rl.codec import TextCodec
from portable_rl.rl.config import EnvironmentConfig
from portable_rl.rl.dapo import build_batch
from portable_rl.rl.learner import turn_metrics
from portable_rl.rl.multihost import decode, encode, groups_from_wire, groups_to_wire
from portable_rl.rl.rollout import ScoredGroup, collect_groups
from portable_rl.rl.scoring import generate_and_score
from portable_rl.rl.turns import EnvironmentPromptError, run_trajectories, turn_seed
from portable_rl.tasks import ArithmeticTask, Example, get_reward
from portable_rl.convert.tiny_checkpoint import char_tokenizer
from portable_rl.rl.dapo import dapo_config


@register_environment("test_calculator")
class Calculator(Environment):
    """`calc:<a>+<b>` → observation `=<sum>`; `answer:<n>` → reward 1 if n is the example's answer, done.
    `slow_s` / `fail`: a step that sleeps / raises (for the time limit and errors)."""

    def __init__(self, slow_s: float = 0.0, fail: bool = False):
        self.slow_s, self.fail, self.closed = slow_s, fail, False

    def reset(self, example):
        self.example = example
        return example.prompt

    def step(self, action_text):
        time.sleep(self.slow_s)
        if self.fail:
            raise RuntimeError("the tool crashed")
        if action_text.startswith("calc:"):
            a, b = action_text[5:].split("+")
            return Step(f"={int(a) + int(b)}", 0.0, False, {})
        if action_text.startswith("answer:"):
            return Step(None, float(action_text[7:] == self.example.answer), True, {})
        return Step(None, 0.0, True, {"error": "format"})

    def close(self):
        self.closed = True


@register_environment("test_forever")
class Forever(Environment):
    """Never done: every turn gets the observation `ok` and reward 0.25."""

    def reset(self, example):
        return example.prompt

    def step(self, action_text):
        return Step("ok", 0.25, False, {})


class ScriptedEngine(EngineAdapter):
    """A sampler with a script: for each input (its decoded text) `policy(text, seed) -> (response text, eos)`;
    logprob of response token t: -0.01·(t+1). Records every generate call's (prompt count, sampling)."""

    def __init__(self, codec, policy):
        self.codec, self.policy, self.calls = codec, policy, []

    def generate(self, prompt_token_ids, sampling, seeds=None):
        self.calls.append((len(prompt_token_ids), sampling) if seeds is None else
                          (len(prompt_token_ids), sampling, list(seeds)))
        out, first = [], prompt_seeds(sampling, seeds, len(prompt_token_ids))
        for i, p in enumerate(prompt_token_ids):
            for j in range(sampling.n):
                text, eos = self.policy(self.codec.tokenizer.decode(p, skip_special_tokens=True),
                                        None if first[i] is None else first[i] + j)
                ids = self.codec.tokenizer.encode(text, add_special_tokens=False) + ([self.codec.eos_id] if eos else [])
                out.append(Rollout(i, list(p), ids, [-0.01 * (t + 1) for t in range(len(ids))],
                                   "stop" if eos else "length"))
        return out

    def update_weights(self, named_tensors):
        pass

    def close(self):
        pass


def calculator_policy(text, seed):
    """Turn 0: ask the tool for the sum; turn 1: answer with the tool's result (odd seeds: one too many)."""
    if "=" not in text.split("=", 1)[1]:
        return "calc:" + text.rsplit("=", 1)[0].replace(" ", ""), True
    result = int(text.rsplit("=", 1)[1])
    return f"answer:{result + seed % 2}", True


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    path = tmp_path_factory.mktemp("env_tokenizer")
    char_tokenizer().save_pretrained(path)
    return TextCodec(path)


EXAMPLES = [Example("37+48=", "85"), Example("12+30=", "42"), Example("5+9=", "14")]
SAMPLING = SamplingConfig(n=2, seed=100, max_tokens=16)


def test_environment_registry_names_the_known_ones():
    assert {"single_turn", "test_calculator"} <= set(available_environments())
    assert get_environment("single_turn") is SingleTurnEnvironment
    with pytest.raises(UnknownEnvironmentError, match="set rl.EnvironmentConfig.name to one of .*single_turn"):
        get_environment("sql?")
    with pytest.raises(ValueError, match="already registered"):
        register_environment("single_turn")(SingleTurnEnvironment)
    with pytest.raises(ConfigError, match="max_turns=0"):
        EnvironmentConfig(max_turns=0)


def test_single_turn_is_todays_call_and_rollouts(codec):
    """The default environment: one generate call with the given sampling, the engine's Rollout objects
    themselves (no mask), and reward_fn's value as the score."""
    task = ArithmeticTask(num_digits=2, num_eval=4, seed=3)
    examples = task.train_batch(0, 0, 4)
    engine = ScriptedEngine(codec, lambda text, seed: (("85", "x", "42")[seed % 3], seed % 2 == 0))
    reward = get_reward("exact_match")
    scored = generate_and_score(engine, codec, examples, reward, SAMPLING)
    assert engine.calls == [(4, SAMPLING)]
    direct = ScriptedEngine(codec, engine.policy).generate([codec.encode_prompt(e.prompt) for e in examples], SAMPLING)
    for got, want in zip(scored.rollouts, direct):
        assert got == want and got.response_mask is None and got.turn_index is None
    want_scores = [reward(codec.decode_response(r.response_token_ids), examples[r.prompt_index].answer) for r in direct]
    assert scored.scores == want_scores
    assert [t.finish for t in scored.trajectories] == ["done"] * 8 and {t.num_turns for t in scored.trajectories} == {1}


def test_calculator_trajectories_are_tokens_in_tokens_out(codec):
    engine = ScriptedEngine(codec, calculator_policy)
    env = EnvironmentConfig(name="test_calculator", max_turns=4)
    scored = generate_and_score(engine, codec, EXAMPLES, get_reward("exact_match"), SAMPLING, env)
    # turn 0: today's call; turn 1: ONE call over all 6 active trajectories, n=1, the turn's seed
    assert engine.calls[0] == (3, SAMPLING)
    assert engine.calls[1] == (6, SamplingConfig(n=1, seed=turn_seed(100, 1), max_tokens=16))
    assert len(engine.calls) == 2
    for t, traj in enumerate(scored.trajectories):
        p, j = divmod(t, 2)
        r = traj.rollout
        assert r.prompt_index == p and r.prompt_token_ids == codec.encode_prompt(EXAMPLES[p].prompt)
        a, b = EXAMPLES[p].prompt[:-1].split("+")
        turn0 = codec.tokenizer.encode(f"calc:{a}+{b}") + [codec.eos_id]
        obs = codec.encode_observation(f"={int(a) + int(b)}")
        seed = turn_seed(100, 1) + t  # trajectory t's turn-1 seed
        turn1 = codec.tokenizer.encode(f"answer:{int(a) + int(b) + seed % 2}") + [codec.eos_id]
        assert r.response_token_ids == turn0 + obs + turn1
        assert r.response_mask == [1] * len(turn0) + [0] * len(obs) + [1] * len(turn1)
        assert r.turn_index == [0] * (len(turn0) + len(obs)) + [1] * len(turn1)
        assert r.response_logprobs[len(turn0):len(turn0) + len(obs)] == [0.0] * len(obs)
        assert r.response_logprobs[:len(turn0)] == [-0.01 * (k + 1) for k in range(len(turn0))]  # as returned
        assert traj.finish == "done" and traj.num_turns == 2
        assert traj.reward == float(seed % 2 == 0)


def test_a_turn_is_seeded_by_its_trajectory_not_by_which_others_still_run(codec):
    """Odd trajectories answer at turn 0 and end; turn 1 is one call over trajectories 0, 2, 4, each seeded
    S_1 + t (its own index), as it would be with all six still running."""
    def policy(text, seed):
        if "calc:" in text:  # turn 1
            return f"answer:{seed}", True
        return ("calc:1+1", True) if seed % 2 == 0 else ("answer:0", True)

    engine = ScriptedEngine(codec, policy)
    trajs, _ = run_trajectories(engine, codec, EXAMPLES, Calculator, SAMPLING,
                                EnvironmentConfig(name="test_calculator", max_turns=4))
    s1 = turn_seed(100, 1)
    assert engine.calls == [(3, SAMPLING), (3, SamplingConfig(n=1, seed=s1, max_tokens=16), [s1, s1 + 2, s1 + 4])]
    assert [t.num_turns for t in trajs] == [2, 1] * 3
    for t in (0, 2, 4):
        assert codec.decode_response(trajs[t].rollout.response_token_ids).endswith(f"answer:{s1 + t}")


def test_finish_reasons_and_failing_environments_end_only_their_trajectory(codec):
    engine = ScriptedEngine(codec, lambda text, seed: ("go", True))
    forever = EnvironmentConfig(name="test_forever", max_turns=3)
    trajs, _ = run_trajectories(engine, codec, EXAMPLES[:1], lambda: Forever(), SAMPLING, forever)
    assert [(t.finish, t.num_turns, t.reward) for t in trajs] == [("max_turns", 3, 0.75)] * 2
    assert len(engine.calls) == 3  # no observation after the last turn, no fourth call
    assert trajs[0].rollout.response_mask[-3:] == [1, 1, 1]

    prompt = len(codec.encode_prompt(EXAMPLES[0].prompt))
    budget = EnvironmentConfig(name="test_forever", max_turns=10, max_total_tokens=prompt + 8)
    trajs, _ = run_trajectories(engine, codec, EXAMPLES[:1], lambda: Forever(), SAMPLING, budget)
    assert all(t.finish == "token_budget" and len(t.rollout.prompt_token_ids) + len(t.rollout.response_token_ids)
               <= prompt + 8 for t in trajs)

    slow = EnvironmentConfig(name="test_calculator", max_turns=2, step_timeout_s=0.2)
    calls = iter(range(100))
    envs = lambda: Calculator(slow_s=3.0 if next(calls) == 1 else 0.0)  # noqa: E731  (trajectory 1 hangs)
    start = time.perf_counter()
    trajs, _ = run_trajectories(ScriptedEngine(codec, calculator_policy), codec, EXAMPLES[:1], envs, SAMPLING, slow)
    assert time.perf_counter() - start < 2.5  # not waiting out the hung step
    assert trajs[1].finish == "env_timeout" and trajs[1].reward == 0.0 and "step_timeout_s" in trajs[1].info["error"]
    assert trajs[0].finish == "done" and trajs[0].num_turns == 2

    one_worker = EnvironmentConfig(name="test_calculator", max_turns=2, step_timeout_s=0.2, workers=1)
    trajs, _ = run_trajectories(ScriptedEngine(codec, calculator_policy), codec, EXAMPLES[:1],
                                lambda: Calculator(slow_s=3.0), SAMPLING, one_worker)
    assert [t.finish for t in trajs] == ["env_timeout"] * 2  # the second never got the worker the first holds
    assert "never started" in trajs[1].info["error"]

    failing = EnvironmentConfig(name="test_calculator", max_turns=2)
    trajs, _ = run_trajectories(ScriptedEngine(codec, calculator_policy), codec, EXAMPLES[:1],
                                lambda: Calculator(fail=True), SAMPLING, failing)
    crashed = ("env_error", 0.0, "RuntimeError: the tool crashed")
    assert [(t.finish, t.reward, t.info["error"]) for t in trajs] == [crashed] * 2


def test_a_turn_cut_at_max_tokens_is_closed_by_the_observation(codec):
    """No EOS at the end of a turn (max_tokens): the observation starts with one, not sampled (mask 0)."""
    engine = ScriptedEngine(codec, lambda text, seed: ("go", False))
    trajs, _ = run_trajectories(engine, codec, EXAMPLES[:1], lambda: Forever(), SAMPLING,
                                EnvironmentConfig(max_turns=2))
    r = trajs[0].rollout
    go = codec.tokenizer.encode("go")
    obs = [codec.eos_id] + codec.encode_observation("ok")
    assert r.response_token_ids == go + obs + go and r.response_mask == [1, 1] + [0] * len(obs) + [1, 1]
    assert r.finish_reason == "length"


def _calculator_groups(codec):
    engine = ScriptedEngine(codec, calculator_policy)
    scored = generate_and_score(engine, codec, EXAMPLES, get_reward("exact_match"), SAMPLING,
                                EnvironmentConfig(name="test_calculator", max_turns=4))
    return [ScoredGroup(EXAMPLES[p], scored.rollouts[2 * p:2 * p + 2], scored.rewards[2 * p:2 * p + 2])
            for p in range(3)]


def _model_tokens(arrays):
    """Multiset of (position in its sequence, token id) where response_mask is 1."""
    on = arrays["response_mask"] > 0
    return sorted(zip(arrays["positions"][on].tolist(), arrays["input_ids"][on].tolist()))


def test_observation_tokens_are_masked_in_every_layout(codec):
    groups = _calculator_groups(codec)
    cfg = dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=2, max_response_tokens=16)
    view, _ = build_batch(cfg, groups, codec.pad_id)
    rollouts = [r for g in groups for r in g.rollouts]
    for i, r in enumerate(rollouts):
        p = len(r.prompt_token_ids)
        obs = p + np.flatnonzero(np.array(r.response_mask) == 0)
        model = p + np.flatnonzero(np.array(r.response_mask) == 1)
        assert not view["response_mask"][i, obs].any() and not view["rollout_logprobs"][i, obs].any()
        assert not view["advantages"][i, obs].any()
        assert view["response_mask"][i, model].all()
        np.testing.assert_array_equal(view["turn_index"][i, p:p + len(r.turn_index)], r.turn_index)
    n = len(rollouts)
    lengths, prompt_lengths = view["seq_len"], view["prompt_len"]
    keys = [view["input_ids"][i, :prompt_lengths[i]].tobytes() for i in range(n)]
    seq = np.arange(n)
    layouts = {"one per row": batching.one_per_row(seq, lengths, *view["input_ids"].shape),
               "packed": batching.packed(seq, lengths, 64),
               "shared prompts": batching.shared_prompt_packed(seq, lengths, prompt_lengths, keys, 64)}
    want = _model_tokens({**view, "positions": np.broadcast_to(np.arange(view["input_ids"].shape[1]),
                                                                 view["input_ids"].shape)})
    for name, layout in layouts.items():
        arrays = layout.arrays({k: view[k] for k in ("input_ids", "response_mask", "rollout_logprobs", "advantages")})
        assert _model_tokens(arrays) == want, name
        assert not arrays["rollout_logprobs"][arrays["response_mask"] == 0].any(), name
        assert not arrays["advantages"][arrays["response_mask"] == 0].any(), name


def test_sequence_tis_and_per_turn_kl_count_model_tokens_only(codec):
    groups = _calculator_groups(codec)
    cfg = dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=2, max_response_tokens=16)
    view, _ = build_batch(cfg, groups, codec.pad_id)
    mask, rollout = view["response_mask"], view["rollout_logprobs"]
    rng = np.random.default_rng(0)
    old = (rollout + rng.normal(0, 0.05, rollout.shape)).astype(np.float32) * mask
    seq_tis = tis.RolloutCorrectionConfig(mode="sequence", clip=4.0)
    weights, _, metrics = tis.apply_rollout_correction(seq_tis, old, rollout, mask)
    want = np.minimum(np.exp(((old - rollout) * mask).sum(axis=1)), 4.0)                   # [N]
    on = mask > 0
    np.testing.assert_allclose(np.asarray(weights)[on], np.broadcast_to(want[:, None], mask.shape)[on], rtol=1e-5)
    # what the learner scores on observation tokens changes nothing
    noisy = np.where(on, old, rng.normal(0, 5, old.shape)).astype(np.float32)
    noisy_weights, _, noisy_metrics = tis.apply_rollout_correction(seq_tis, noisy, rollout, mask)
    np.testing.assert_array_equal(np.asarray(noisy_weights), np.asarray(weights))
    assert float(noisy_metrics["kl"]) == float(metrics["kl"]) and float(metrics["valid_tokens"]) == mask.sum()
    per_turn = turn_metrics(old, rollout, mask, view["turn_index"])
    assert set(per_turn) == {"tis/kl/turn_0", "tis/kl/turn_1"}
    for k in (0, 1):
        sel = on & (view["turn_index"] == k)
        assert per_turn[f"tis/kl/turn_{k}"] == pytest.approx(float((rollout - old)[sel].mean()), rel=1e-6)
    assert turn_metrics(old, rollout, mask, np.zeros_like(view["turn_index"])) == {}  # single-turn: none


def test_multi_turn_rollouts_cross_the_wire_exactly(codec):
    groups = _calculator_groups(codec)
    cfg = dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=2, max_response_tokens=16)
    want, want_stats = build_batch(cfg, groups, codec.pad_id)
    got, got_stats = build_batch(cfg, groups_from_wire(decode(encode(groups_to_wire(groups)))), codec.pad_id)
    assert got.keys() == want.keys() and got_stats == want_stats
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_collect_groups_reports_turns_finish_reasons_and_env_time(codec):
    class Task:
        reward = "exact_match"

        def train_batch(self, step, draw, batch_size):
            return EXAMPLES[:batch_size]

    cfg = dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=2, max_gen_batches=1, max_response_tokens=16)
    groups, stats = collect_groups(ScriptedEngine(codec, calculator_policy), codec, Task(), get_reward("exact_match"),
                                   cfg, step=1, seed=0, environment=EnvironmentConfig(name="test_calculator",
                                                                                      max_turns=4))
    assert stats["turns/mean"] == 2.0 and stats["finish/done"] == 1.0 and stats["finish/max_turns"] == 0.0
    assert stats["time/env"] > 0 and len(groups) == 3


def bpe_tokenizer(vocab_size=128):
    """A byte-pair tokenizer over the char tokenizer's alphabet, with merges (like a real model's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from portable_rl.convert.tiny_checkpoint import CHARS, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="isolated")
    tok.decoder = decoders.Fuse()
    corpus = [f"calc:{a}+{b} answer:{a + b} the tool said ={a * b}" for a in range(40) for b in range(40)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                                        initial_alphabet=list(CHARS)))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)


def retokenization_drift(tokenizer, prompt_ids, response_ids) -> int:
    """Token positions at which re-tokenizing the decoded trajectory differs from its ids (the first
    difference shifts everything after it, so: the tokens from the first differing one on)."""
    ids = list(prompt_ids) + list(response_ids)
    again = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
    same = next((k for k, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
    return max(len(ids), len(again)) - same


def test_retokenizing_the_text_changes_tokens_the_driver_keeps(tmp_path):
    """A model may sample a non-canonical split of a word (`calc` as c·a·l·c); the driver keeps those ids,
    re-tokenizing the decoded text would hand the learner other tokens than the engine sampled."""
    bpe_tokenizer().save_pretrained(tmp_path)
    codec = TextCodec(tmp_path, add_bos=False)
    char_ids = lambda s: [codec.tokenizer.convert_tokens_to_ids(c) for c in s]  # noqa: E731

    class CharEngine(ScriptedEngine):  # samples the calculator policy's text one character per token
        def generate(self, prompt_token_ids, sampling, seeds=None):
            out = []
            for i, p in enumerate(prompt_token_ids):
                for j in range(sampling.n):
                    text, _ = calculator_policy(codec.tokenizer.decode(p, skip_special_tokens=True), 0)
                    ids = char_ids(text) + [codec.eos_id]
                    out.append(Rollout(i, list(p), ids, [-0.1] * len(ids), "stop"))
            return out

    trajs, _ = run_trajectories(CharEngine(codec, None), codec, EXAMPLES[:1], lambda: Calculator(),
                                SAMPLING, EnvironmentConfig(max_turns=4))
    r = trajs[0].rollout
    assert trajs[0].finish == "done" and trajs[0].reward == 1.0
    assert r.response_token_ids[:11] == char_ids("calc:37+48") + [codec.eos_id]  # exactly as sampled
    drift = retokenization_drift(codec.tokenizer, r.prompt_token_ids, r.response_token_ids)
    total = len(r.prompt_token_ids) + len(r.response_token_ids)
    print(f"re-tokenizing departs from the sampled ids for the last {drift} of {total} tokens")
    assert drift > 10  # tokens a re-tokenizing trainer would score instead of the sampled ones


def test_observation_ids_continue_the_chat_template_exactly(tmp_path):
    """prompt ids + the turn as sampled (ending in EOS) + the observation's ids = the template's rendering of
    the whole conversation, tokenized: an observation is the template's user turn and the next turn's start."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<bos>{{ m.role }}: {{ m.content }}<eos> {% endfor %}"
                               "{% if add_generation_prompt %}<bos>assistant: {% endif %}")
    tokenizer.save_pretrained(tmp_path)
    codec = TextCodec(tmp_path, chat_template=True, add_bos=False)
    first = [{"role": "user", "content": "37+48="}]
    turn = codec.tokenizer.encode("calc:37+48", add_special_tokens=False) + [codec.eos_id]
    ids = codec.encode_messages(first) + turn + codec.encode_observation("=85", "tool")
    whole = codec.tokenizer.apply_chat_template(
        first + [{"role": "assistant", "content": "calc:37+48"}, {"role": "tool", "content": "=85"}],
        add_generation_prompt=True, tokenize=False)
    assert ids == codec.tokenizer.encode(whole, add_special_tokens=False)
    assert codec.encode_observation("=85", "tool", after_eos=False)[0] == codec.eos_id
    with pytest.raises(ConfigError, match="chat_template = True"):
        TextCodec(tmp_path).encode_messages(first)


def test_the_docs_calculator_runs_through_the_driver(codec):
    """docs/environments.md's ~30-line environment, as printed there, on a two-turn trajectory."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    source = doc.split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(source.replace('"calculator"', '"docs_calculator"'), "environments.md", "exec"), namespace)

    def policy(text, seed):
        return ("<answer>85</answer>", True) if "<result>85</result>" in text else ("<calc>37+48</calc>", True)

    trajs, _ = run_trajectories(ScriptedEngine(codec, policy), codec, EXAMPLES[:1], namespace["Calculator"],
                                SamplingConfig(n=1, max_tokens=32), EnvironmentConfig(max_turns=4))
    assert (trajs[0].finish, trajs[0].num_turns, trajs[0].reward) == ("done", 2, 1.0)


class LimitedEngine(ScriptedEngine):
    """The scripted sampler with vLLM's limits and stop strings: a prompt of `max_model_len` tokens or more raises
    (vLLM's input check), a response stops at max_model_len − len(prompt) (finish 'length'), and a response
    stops after the first character completing a stop string (the char tokenizer: one token per character)."""

    def __init__(self, codec, policy, max_model_len):
        super().__init__(codec, policy)
        self.max_model_len = max_model_len

    def generate(self, prompt_token_ids, sampling, seeds=None):
        for p in prompt_token_ids:
            if len(p) >= self.max_model_len:
                raise ValueError(f"The decoder prompt (length {len(p)}) is longer than the maximum model length")
        out = []
        for r in super().generate(prompt_token_ids, sampling, seeds):
            ids, finish = r.response_token_ids[:sampling.max_tokens], r.finish_reason
            finish = finish if len(ids) == len(r.response_token_ids) else "length"
            text = self.codec.tokenizer.decode(ids, skip_special_tokens=True)
            ends = [text.find(s) + len(s) for s in sampling.stop if s in text]
            if ends:
                ids, finish = ids[:min(ends)], "stop"
            room = self.max_model_len - len(r.prompt_token_ids)
            if len(ids) > room:
                ids, finish = ids[:room], "length"
            out.append(Rollout(r.prompt_index, r.prompt_token_ids, ids, r.response_logprobs[:len(ids)], finish))
        return out


@register_environment("test_tagged")
class Tagged(Environment):
    """Declares a stop string; every turn gets the observation `ok` until a turn holds `<done>`."""

    stop_strings = ("</q>",)

    def reset(self, example):
        return example.prompt

    def step(self, action_text):
        self.seen = action_text
        return Step(None, 1.0, True, {}) if "<done>" in action_text else Step("ok", 0.0, False, {})


def test_environment_stop_strings_reach_every_turn_and_end_it_with_the_string(codec):
    from portable_rl.environments.sql import SqlEnvironment

    assert SqlEnvironment.stop_strings == ("</sql>", "</solution>") and SingleTurnEnvironment.stop_strings == ()
    def policy(text, seed):
        return ("<q>1+1</q> and more" if text.count("ok") < 2 else "<done> then </q> more"), True

    engine = LimitedEngine(codec, policy, max_model_len=512)
    envs = []

    def make():
        envs.append(Tagged())
        return envs[-1]

    sampling = dataclasses.replace(SAMPLING, stop=("STOP",))
    trajs, _ = run_trajectories(engine, codec, EXAMPLES[:1], make, sampling,
                                EnvironmentConfig(name="test_tagged", max_turns=4))
    assert [c[1].stop for c in engine.calls] == [("STOP", "</q>")] * 3  # the caller's, then the environment's
    assert [(t.finish, t.num_turns, t.reward) for t in trajs] == [("done", 3, 1.0)] * 2
    r = trajs[0].rollout
    turns = [codec.decode_response([tok for tok, k, m in zip(r.response_token_ids, r.turn_index, r.response_mask)
                                    if k == turn and m]) for turn in range(3)]
    assert turns == ["<q>1+1</q>", "<q>1+1</q>", "<done> then </q>"]  # each turn ends with the string, kept
    assert envs[0].seen == "<done> then </q>"
    # no EOS after a stop string: the observation starts with one, not sampled
    first = len(codec.tokenizer.encode("<q>1+1</q>"))
    assert r.response_token_ids[first] == codec.eos_id and r.response_mask[first] == 0
    with pytest.raises(ValueError, match=r"stop=\('x',\)"):
        SamplingConfig(stop="x")
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingConfig(stop=("",))


def test_growing_prompts_end_at_the_engines_max_model_len_not_in_an_engine_error(codec):
    """Later turns feed prompt + every earlier turn: with max_model_len 40 the trajectories end 'token_budget',
    no call passes the engine a prompt it would refuse, and each call's max_tokens is cut to the room left."""
    engine = LimitedEngine(codec, lambda text, seed: ("gogogo", True), max_model_len=40)
    forever = EnvironmentConfig(name="test_forever", max_turns=20)
    trajs, _ = run_trajectories(engine, codec, EXAMPLES, lambda: Forever(), SAMPLING, forever)
    assert {t.finish for t in trajs} == {"token_budget"}
    for t in trajs:
        assert len(t.rollout.prompt_token_ids) + len(t.rollout.response_token_ids) <= 40 and t.num_turns >= 2
    for n_prompts, sampling in engine.calls:
        assert sampling.max_tokens <= SAMPLING.max_tokens
    assert min(s.max_tokens for _, s in engine.calls) < SAMPLING.max_tokens  # cut to the room left
    # a turn that runs into the limit without stopping is cut there and not stepped
    long = LimitedEngine(codec, lambda text, seed: ("g" * 30, False), max_model_len=40)
    trajs, _ = run_trajectories(long, codec, EXAMPLES[:1], lambda: Forever(), SAMPLING, forever)
    assert [(t.finish, t.reward) for t in trajs] == [("token_budget", 0.25)] * 2  # turn 0 stepped, turn 1 cut

    with pytest.raises(ConfigError, match=r"max_total_tokens=64 but the engine serves at most 40 tokens .*"
                                          r"MAX_MODEL_LEN = 64\) or lower max_total_tokens to 40"):
        run_trajectories(engine, codec, EXAMPLES, lambda: Forever(), SAMPLING,
                         EnvironmentConfig(name="test_forever", max_turns=2, max_total_tokens=64))
    with pytest.raises(EnvironmentPromptError, match="the prompt of example 0 has 7 tokens, no room for a turn "
                                                     "within 6"):
        run_trajectories(LimitedEngine(codec, engine.policy, max_model_len=6), codec, EXAMPLES, lambda: Forever(),
                         SAMPLING, forever)
