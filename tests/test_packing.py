"""Packed rows (rl/batching.py): first-fit decreasing, segment ids / positions, the per-sequence index, and
that a packed row scores its sequences exactly as one-sequence-per-row padding does."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.model import Transformer
from portable_rl.rl import batching
from portable_rl.rl.batching import (MicroBatchBudgetError, first_fit_decreasing, pack_rollouts, packed_row_length,
                                     round_rows)
from portable_rl.rl.learner import row_logprobs


def padding_fraction(batch: dict) -> float:
    """Padding tokens / all tokens of the [R, L] arrays."""
    return 1.0 - float(batch["attention_mask"].sum()) / batch["attention_mask"].size


def test_first_fit_decreasing_by_hand():
    # longest first: 9 → bin 0, 7 → bin 1, 5 → bin 2, 3 → bin 1 (room 3), 2 → bin 2 (bin 0 has room 1)
    row, start, slot, bins = first_fit_decreasing([5, 9, 3, 7, 2], capacity=10)
    assert bins == 3
    np.testing.assert_array_equal(row, [2, 0, 1, 1, 2])
    np.testing.assert_array_equal(start, [0, 0, 7, 0, 5])
    np.testing.assert_array_equal(slot, [1, 1, 2, 1, 2])
    with pytest.raises(MicroBatchBudgetError, match="a sequence of 11 tokens does not fit a row of 10"):
        first_fit_decreasing([3, 11], capacity=10)


def test_first_fit_decreasing_never_overlaps_or_overflows():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 40, rng.integers(1, 60))
        row, start, slot, bins = first_fit_decreasing(lengths, capacity=48)
        used = np.zeros((bins, 48), int)
        for r, s, n in zip(row, start, lengths):
            used[r, s:s + n] += 1
        assert used.max() == 1 and used.sum() == lengths.sum()              # disjoint, inside the rows
        assert bins >= -(-lengths.sum() // 48)
        # first fit, longest first: when a sequence was placed, no earlier row had room for it
        fill = np.zeros(bins, int)
        for i in np.argsort(-lengths, kind="stable"):
            assert (48 - fill[:row[i]] < lengths[i]).all() and start[i] == fill[row[i]]
            fill[row[i]] += lengths[i]


def test_row_shapes_for_jit():
    assert [packed_row_length(n) for n in (3, 16, 17, 64, 65, 130)] == [16, 16, 32, 64, 128, 192]
    assert [round_rows(n) for n in (1, 3, 8, 9, 11, 17, 33, 100)] == [1, 3, 8, 10, 12, 20, 40, 112]
    assert round_rows(5, 4) == 8 and round_rows(33, 2) == 40   # multiples of the shard count (17 units → 20)


PROMPTS = [[1, 5, 6], [1, 7], [1, 2, 3, 4]]
RESPONSES = [[8, 9, 2], [3], [10, 11, 12, 13, 14]]
LOGPS = [[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6, -0.7, -0.8, -0.9]]
ADV = [1.5, -2.0, 0.5]


def test_pack_rollouts_packed_rows_by_hand():
    # lengths 6, 3, 9 in rows of 12: 9 → row 0, 6 → row 1, 3 → row 0 (room 3)
    b = pack_rollouts(PROMPTS, RESPONSES, LOGPS, ADV, pad_id=99, pack=True, row_tokens=12)
    assert b["input_ids"].shape == (2, 12) and batching.num_rows(b) == 2 and batching.num_sequences(b) == 3
    np.testing.assert_array_equal(b["seq_row"], [1, 0, 0])
    np.testing.assert_array_equal(b["seq_start"], [0, 9, 0])
    np.testing.assert_array_equal(b["seq_len"], [6, 3, 9])
    np.testing.assert_array_equal(b["prompt_len"], [3, 2, 4])
    np.testing.assert_array_equal(b["input_ids"][0], [1, 2, 3, 4, 10, 11, 12, 13, 14, 1, 7, 3])
    np.testing.assert_array_equal(b["input_ids"][1], [1, 5, 6, 8, 9, 2] + [99] * 6)
    np.testing.assert_array_equal(b["segment_ids"], [[1] * 9 + [2] * 3, [1] * 6 + [0] * 6])
    np.testing.assert_array_equal(b["positions"], [list(range(9)) + [0, 1, 2], list(range(6)) + [0] * 6])
    np.testing.assert_array_equal(b["attention_mask"], b["segment_ids"] > 0)
    np.testing.assert_array_equal(b["response_mask"][0], [0] * 4 + [1] * 5 + [0, 0, 1])
    np.testing.assert_allclose(b["rollout_logprobs"][0, 9:], [0, 0, -0.4])
    np.testing.assert_allclose(b["advantages"][1], [0, 0, 0, 1.5, 1.5, 1.5] + [0] * 6)
    assert padding_fraction(b) == pytest.approx(6 / 24)
    # default row length: the longest sequence (9) rounded to a power of two (16): 9 + 6 in row 0, 3 in row 1
    default = pack_rollouts(PROMPTS, RESPONSES, LOGPS, ADV, pack=True)
    assert default["input_ids"].shape == (2, 16)
    np.testing.assert_array_equal(default["seq_row"], [0, 1, 0])


def test_unpacked_layout_carries_segment_ids_and_positions():
    b = pack_rollouts(PROMPTS, RESPONSES, LOGPS, ADV, min_len=4, row_multiple=4)
    assert b["input_ids"].shape == (4, 16) and batching.num_rows(b) == 3
    np.testing.assert_array_equal(b["segment_ids"], b["attention_mask"])
    np.testing.assert_array_equal(b["positions"][2], list(range(9)) + [0] * 7)
    np.testing.assert_array_equal(b["seq_row"], [0, 1, 2])
    np.testing.assert_array_equal(b["seq_start"], [0, 0, 0])
    assert padding_fraction(b) == pytest.approx(1 - 18 / 64)


def test_layout_round_trip_between_view_and_rows():
    view = pack_rollouts(PROMPTS, RESPONSES, LOGPS, ADV, min_len=4)
    layout = batching.packed(np.arange(3), view["seq_len"], row_tokens=12)
    rows = layout.arrays({k: view[k] for k in ("input_ids", "response_mask", "rollout_logprobs", "advantages")})
    direct = pack_rollouts(PROMPTS, RESPONSES, LOGPS, ADV, pack=True, row_tokens=12)
    for k in batching.ROW_KEYS:
        np.testing.assert_array_equal(rows[k], direct[k], err_msg=k)
    back = layout.to_view(rows["rollout_logprobs"], np.zeros_like(view["rollout_logprobs"]))
    np.testing.assert_array_equal(back, view["rollout_logprobs"])
    parts = batching.split_rows_of(layout, 1)
    assert [p.shape for p in parts] == [(1, 12), (1, 12)]
    assert sorted(np.concatenate([p.seq for p in parts])) == [0, 1, 2]


def test_first_token_of_a_sequence_is_never_a_response_token():
    b = pack_rollouts([[], [4]], [[7, 8], [9]], [[-1.0, -2.0], [-3.0]], [1.0, 1.0], pack=True, row_tokens=8)
    # the empty-prompt sequence's first token would be scored from the other sequence's last token
    assert b["response_mask"].sum() == 2


@pytest.mark.slow  # a model compiled per implementation (~15-30 s on 2 busy cores)
@pytest.mark.parametrize("impl", ["dense", "blockwise"])
def test_packed_row_logprobs_equal_one_sequence_per_row(impl):
    from portable_rl.learner_jax import attention

    if impl not in attention.IMPLS:
        pytest.skip(f"attention_impl={impl!r} not in learner_jax/attention.py yet")
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Transformer(cfg, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
                        attention_impl=impl)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 64, rng.integers(1, 6)).tolist() for _ in range(7)]
    responses = [rng.integers(1, 64, rng.integers(1, 12)).tolist() for _ in range(7)]
    logps = [[-1.0] * len(r) for r in responses]
    view = pack_rollouts(prompts, responses, logps, [0.0] * 7)
    rows = pack_rollouts(prompts, responses, logps, [0.0] * 7, pack=True, row_tokens=24)
    assert rows["input_ids"].shape[0] < 7 and rows["segment_ids"].max() >= 2    # really packed
    want, want_entropy = sequence_logprobs(model, view["input_ids"], view["attention_mask"])
    got, got_entropy = row_logprobs(model, rows, 1.0)
    layout = batching.Layout(seq=np.arange(7), row=rows["seq_row"], start=rows["seq_start"], length=rows["seq_len"],
                             segment=np.ones(7, np.int32), rows=rows["input_ids"].shape[0], row_tokens=24)
    mask = view["response_mask"] > 0
    got_view = layout.to_view(np.asarray(got), np.zeros(view["input_ids"].shape, np.float32))
    ent_view = layout.to_view(np.asarray(got_entropy), np.zeros(view["input_ids"].shape, np.float32))
    np.testing.assert_allclose(got_view[mask], np.asarray(want)[mask], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent_view[mask], np.asarray(want_entropy)[mask], rtol=1e-5, atol=1e-5)


def _groups(rng, n_groups, n_samples, vocab=64, max_prompt=9, max_response=12):
    prompts, responses = [], []
    for _ in range(n_groups):
        prompt = rng.integers(1, vocab, rng.integers(2, max_prompt)).tolist()
        for _ in range(n_samples):
            prompts.append(prompt)
            responses.append(rng.integers(1, vocab, rng.integers(1, max_response)).tolist())
    return prompts, responses


def test_shared_prompt_layout_by_hand():
    """Two sequences of one 4-token prompt [5 6 7 8] (responses [1 2], [3]) and one of another prompt:
    the prompt's first 3 tokens once, then per sequence the last prompt token and its response, with
    continuation ids and the positions the sequence has alone; the other prompt is an ordinary segment."""
    from portable_rl.learner_jax.attention import continuation_id

    view = pack_rollouts([[5, 6, 7, 8], [5, 6, 7, 8], [9, 4]], [[1, 2], [3], [6]], [[-1.0, -2.0], [-3.0], [-4.0]],
                         [1.0, 1.0, 1.0])
    keys = [view["input_ids"][i, :p].tobytes() for i, p in enumerate(view["prompt_len"])]
    layout = batching.shared_prompt_packed(np.arange(3), view["seq_len"], view["prompt_len"], keys, row_tokens=16)
    rows = layout.arrays({k: view[k] for k in ("input_ids", "response_mask", "rollout_logprobs")})
    c1, c2 = continuation_id(1, 1), continuation_id(1, 2)   # the group (8 tokens) is placed first: slot 1
    assert rows["input_ids"][0].tolist()[:11] == [5, 6, 7, 8, 1, 2, 8, 3, 9, 4, 6]
    assert rows["segment_ids"][0].tolist() == [1, 1, 1, c1, c1, c1, c2, c2, 2, 2, 2] + [0] * 5
    assert rows["positions"][0].tolist()[:11] == [0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 2]
    assert rows["response_mask"][0].tolist()[:11] == [0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 1]
    assert layout.sequences.tolist() == [0, 1, 2] and int(layout.length.sum()) == 11 < int(view["seq_len"].sum())
    back = layout.to_view(rows["rollout_logprobs"], np.zeros_like(view["rollout_logprobs"]))
    np.testing.assert_array_equal(back * view["response_mask"], view["rollout_logprobs"])


def test_shared_prompt_units_split_to_fit_rows():
    """A group too long for one row is split into units that each carry the prompt; every response
    token is laid out exactly once, no row overflows, and a sequence longer than a row is refused."""
    rng = np.random.default_rng(3)
    prompts, responses = _groups(rng, 5, 8)
    view = pack_rollouts(prompts, responses, [[-1.0] * len(r) for r in responses], [0.0] * len(prompts))
    keys = [view["input_ids"][i, :p].tobytes() for i, p in enumerate(view["prompt_len"])]
    n = len(prompts)
    for row_tokens in (24, 40, 400):
        layout = batching.shared_prompt_packed(np.arange(n), view["seq_len"], view["prompt_len"], keys, row_tokens)
        rows = layout.arrays({k: view[k] for k in ("input_ids", "response_mask")})
        assert rows["response_mask"].sum() == view["response_mask"].sum()
        ends = layout.start + layout.length
        assert ends.max() <= row_tokens
        occupied = np.zeros(layout.shape, int)
        for r, s, ln in zip(layout.row, layout.start, layout.length):
            occupied[r, s:s + ln] += 1
        assert occupied.max() == 1                                   # no two pieces overlap
        assert int(layout.length.sum()) < int(view["seq_len"].sum())
    with pytest.raises(MicroBatchBudgetError, match="does not fit"):
        batching.shared_prompt_packed(np.arange(n), view["seq_len"], view["prompt_len"], keys, 8)


@pytest.mark.slow  # a model compiled (~15 s)
def test_shared_prompt_row_logprobs_equal_one_sequence_per_row():
    """The learner's logprobs and entropies of shared-prompt rows (blockwise attention, small blocks)
    equal each sequence's alone, at every response token."""
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Transformer(cfg, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
                        attention_impl="blockwise")
    rng = np.random.default_rng(2)
    prompts, responses = _groups(rng, 3, 4)
    logps = [[-1.0] * len(r) for r in responses]
    view = pack_rollouts(prompts, responses, logps, [0.0] * len(prompts))
    keys = [view["input_ids"][i, :p].tobytes() for i, p in enumerate(view["prompt_len"])]
    layout = batching.shared_prompt_packed(np.arange(len(prompts)), view["seq_len"], view["prompt_len"], keys, 48)
    rows = layout.arrays({k: view[k] for k in ("input_ids",)})
    assert rows["segment_ids"].max() >= 1 << 16                      # really shared
    want, want_entropy = sequence_logprobs(model, view["input_ids"], view["attention_mask"])
    got, got_entropy = row_logprobs(model, rows, 1.0)
    mask = view["response_mask"] > 0
    got_view = layout.to_view(np.asarray(got), np.zeros(view["input_ids"].shape, np.float32))
    ent_view = layout.to_view(np.asarray(got_entropy), np.zeros(view["input_ids"].shape, np.float32))
    np.testing.assert_allclose(got_view[mask], np.asarray(want)[mask], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent_view[mask], np.asarray(want_entropy)[mask], rtol=1e-5, atol=1e-5)
