"""The loop's small pieces: packing, dynamic sampling, pass@k, metrics writer (resume truncation), plots."""

import json
import math

import numpy as np
import pytest

from portable_rl.rl.batching import bucket_length, num_rows, pack_rollouts
from portable_rl.rl.dynamic_sampling import GroupCollector, informative_groups
from portable_rl.rl.evaluation import pass_at_k, summarize
from portable_rl.rl.metrics import MetricsWriter, read_metrics
from portable_rl.rl.plots import write_plots


def test_bucket_length():
    assert [bucket_length(x) for x in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 128]
    assert bucket_length(5, min_len=4) == 8


def test_pack_rollouts_aligns_logprob_t_with_token_t():
    prompts, responses = [[1, 5, 6], [1, 7]], [[8, 9, 2], [3]]
    logps = [[-0.1, -0.2, -0.3], [-0.4]]
    b = pack_rollouts(prompts, responses, logps, [1.5, -2.0], pad_id=0, min_len=4, row_multiple=4)
    assert b["input_ids"].shape == (4, 8) and num_rows(b) == 2
    np.testing.assert_array_equal(b["input_ids"][0], [1, 5, 6, 8, 9, 2, 0, 0])
    np.testing.assert_array_equal(b["attention_mask"][1], [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b["response_mask"][0], [0, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_allclose(b["rollout_logprobs"][0, 3:6], [-0.1, -0.2, -0.3])
    np.testing.assert_allclose(b["rollout_logprobs"][1], [0, 0, -0.4, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(b["advantages"][1, 2], -2.0)
    assert b["advantages"][1].sum() == -2.0 and not b["response_mask"][2:].any()
    with pytest.raises(ValueError, match="logprobs"):
        pack_rollouts([[1]], [[2, 3]], [[-1.0]], [0.0])


def test_dynamic_sampling_drops_constant_groups_and_stops_at_target():
    rewards = [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]   # 4 groups of 3
    np.testing.assert_array_equal(informative_groups(rewards, 3), [False, True, False, False])
    col = GroupCollector(target_groups=2)
    col.add(["a", "b", "c", "d"], rewards, 3)
    assert not col.done and col.groups == ["b"]
    col.add(["e", "f", "g", "h"], [0, 1, 0] * 4, 3)
    assert col.done and col.take() == ["b", "e"] and col.draws == 2 and col.seen == 8
    off = GroupCollector(target_groups=2, filter_groups=False)
    off.add(["a", "b"], [1, 1, 0, 0], 2)
    assert off.take() == ["a", "b"]


def test_pass_at_k_matches_brute_force():
    from itertools import combinations
    n, c = 6, 2
    outcomes = [1] * c + [0] * (n - c)
    for k in (1, 2, 3, 5):
        brute = np.mean([any(outcomes[i] for i in idx) for idx in combinations(range(n), k)])
        assert math.isclose(pass_at_k(n, c, k), brute)
    s = summarize(np.array([[1, 0], [0, 0]], bool), np.array([[2, 4], [3, 3]]), ks=(1, 2, 4))
    assert s["accuracy"] == 0.25 and s["pass@2"] == 0.5 and s["mean_length"] == 3.0 and "pass@4" not in s


def test_metrics_writer_truncates_rows_after_resume_step_and_plots(tmp_path):
    w = MetricsWriter(tmp_path)
    for step in range(1, 6):
        w.write(step, {"reward/mean": step / 10, "accuracy/heldout": 0.1 * step, "tis/kl": float("nan")})
    w.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[0]["tis/kl"] is None
    w = MetricsWriter(tmp_path, resume_step=3)
    w.write(4, {"reward/mean": 0.99})
    w.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["reward/mean"] == 0.99
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    for p in write_plots(tmp_path):
        assert p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG"


def test_sloppy_teacher_answer_forms():
    from portable_rl.warmstart import _shown_answer

    assert _shown_answer("85", "suffix", "0", 1) == "850"
    assert _shown_answer("85", "offset", "0", 1) == "86"
    with pytest.raises(ValueError, match="integer"):
        _shown_answer("x", "offset", "0", 1)
    with pytest.raises(ValueError, match="noise_kind"):
        _shown_answer("85", "swap", "0", 1)
