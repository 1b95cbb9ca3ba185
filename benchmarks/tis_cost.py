"""Cost of rollout correction + diagnostics as a fraction of one train step, measured in the same run.

    baseline  one jitted train step of the default model (Qwen2 `TINY_SIZES[size]`, random weights):
              forward + backward + AdamW update on a [rows, seq] batch, policy loss with TIS weights
    measured  (a) separate: one jitted `apply_rollout_correction` call (weights, keep mask, every
                  diagnostic) on the same [rows, seq] logprobs, as the training loop calls it
              (b) fused:    the train step with the correction computed inside the loss, minus the
                  plain train step, timed alternately (what it costs once XLA can fuse it; on a
                  loaded CPU this difference is within timing noise)
    target    (a) / baseline < 1%

Times are medians over `--reps` calls after warm-up, `block_until_ready` on every output.

    python -m benchmarks.tis_cost [--size small] [--rows 64] [--seq 48] [--reps 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from portable_rl import tis
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.losses import policy_loss
from portable_rl.learner_jax.model import Transformer
from portable_rl.learner_jax.optim import make_optimizer
from portable_rl.learner_jax.step import make_train_step
from portable_rl.convert.tiny_checkpoint import TINY_SIZES

PRESETS = ("token_tis", "icepop", "everything")


def correction_config(name: str) -> tis.RolloutCorrectionConfig:
    if name == "everything":  # every weight/mask/diagnostic path at once: the most expensive config
        return tis.RolloutCorrectionConfig(
            mode="sequence", clip=2.0, self_normalize=True, token_mask_low=0.5, token_mask_high=5.0,
            geo_mask_low=0.9, geo_mask_high=1.1, product_mask_low=0.1, product_mask_high=10.0,
            veto_low=1e-4, divergence="seq_max_k3", divergence_high=1.0)
    return tis.RolloutCorrectionConfig.preset(name)


def make_batch(rows: int, seq: int, prompt_len: int, vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq // 4, seq - prompt_len + 1, rows)  # response lengths
    pos = np.arange(seq)[None, :]
    response = (pos >= prompt_len) & (pos < prompt_len + lengths[:, None])
    old = np.where(response, np.log(rng.uniform(0.05, 1.0, (rows, seq))), 0.0).astype(np.float32)
    return {
        "input_ids": rng.integers(3, vocab, (rows, seq)).astype(np.int32),
        "attention_mask": (pos < prompt_len + lengths[:, None]).astype(np.int32),
        "response_mask": response.astype(np.float32),
        "old_logprobs": old,
        "rollout_logprobs": (old + 0.05 * rng.standard_normal((rows, seq)) * response).astype(np.float32),
        "advantages": rng.standard_normal(rows).astype(np.float32),
        "tis_weights": response.astype(np.float32),
        "keep_mask": response.astype(np.float32),
    }


def make_loss_fn(fused_config=None):
    def loss_fn(model, batch):
        new, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"])
        weights, keep = batch["tis_weights"], batch["keep_mask"]
        if fused_config is not None:
            weights, keep, tis_metrics = tis.apply_rollout_correction(
                fused_config, batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"])
        loss, metrics = policy_loss(new, batch["old_logprobs"], batch["advantages"],
                                    batch["response_mask"] * keep, correction_weights=weights)
        if fused_config is not None:
            metrics.update({f"tis/{k}": v for k, v in tis_metrics.items()})
        return loss, metrics
    return loss_fn


def median_seconds(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_median_seconds(fn_a, fn_b, reps: int, warmup: int = 2) -> tuple[float, float]:
    """Medians of two functions timed alternately, so machine-load drift hits both equally."""
    for _ in range(warmup):
        jax.block_until_ready(fn_a())
        jax.block_until_ready(fn_b())
    times_a, times_b = [], []
    for _ in range(reps):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(TINY_SIZES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    config = ModelConfig(family="qwen2", vocab_size=128, attention_bias=True, tie_word_embeddings=True,
                         **TINY_SIZES[args.size])
    batch = {k: jnp.asarray(v) for k, v in make_batch(args.rows, args.seq, args.prompt_len, 128).items()}

    def new_state():
        model = Transformer(config, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, make_optimizer(learning_rate=1e-6), wrt=nnx.Param)

    model, optimizer = new_state()
    plain_step = make_train_step(make_loss_fn())
    step_s = median_seconds(lambda: plain_step(model, optimizer, batch), args.reps)

    results = {"device": str(jax.devices()[0]), "size": args.size, "rows": args.rows, "seq": args.seq,
               "train_step_ms": 1e3 * step_s, "presets": {}}
    for name in PRESETS:
        cfg = correction_config(name)
        correct = jax.jit(functools.partial(tis.apply_rollout_correction, cfg))
        sep_s = median_seconds(lambda: correct(batch["old_logprobs"], batch["rollout_logprobs"],
                                               batch["response_mask"]), max(args.reps * 5, 50))
        fused_step = make_train_step(make_loss_fn(cfg))
        plain_s, fused_s = paired_median_seconds(lambda: plain_step(model, optimizer, batch),
                                                 lambda: fused_step(model, optimizer, batch), args.reps)
        results["presets"][name] = {
            "correction_ms": 1e3 * sep_s, "fraction_of_step": sep_s / step_s,
            "fused_step_ms": 1e3 * fused_s, "fused_overhead_fraction": (fused_s - plain_s) / plain_s,
        }

    if args.json:
        print(json.dumps(results))
        return
    print(f"device {results['device']}  model qwen2/{args.size}  batch {args.rows}x{args.seq}  "
          f"train step {results['train_step_ms']:.2f} ms (median of {args.reps})")
    print(f"{'preset':<12} {'correction ms':>14} {'% of step':>10} {'fused step ms':>14} {'fused overhead':>15}")
    for name, r in results["presets"].items():
        ok = "ok" if r["fraction_of_step"] < 0.01 else "OVER 1%"
        print(f"{name:<12} {r['correction_ms']:>14.3f} {100 * r['fraction_of_step']:>9.2f}% "
              f"{r['fused_step_ms']:>14.2f} {100 * r['fused_overhead_fraction']:>14.2f}%  {ok}")


if __name__ == "__main__":
    main()
