"""How far each rollout precision and correction moves the policy gradient from the on-policy one.

    python -m experiments.gradient_fidelity --setting toy [--prompts 16] [--samples 64]
        [--arms fp32 bf16 fp8 int8 mxfp4 fp32x0.7] [--corrections none token_tis seq_mask icepop]
        [--seeds 1 2] [--out runs/gradient_fidelity/toy] [--plot docs/img/gradient_fidelity_toy.png]
    python -m experiments.gradient_fidelity --setting smollm2 --prompts 16 --samples 64 \\
        --arms fp32 fp8 int8 mxfp4 --corrections none token_tis seq_mask icepop

Accuracy after 20 steps cannot separate rollout precisions below ~20 points (seed-to-seed std ~12). This asks
the narrower question directly, at fixed weights: does the update computed from an engine's samples, with a
correction, point where the on-policy update points?

Setup. The learner holds the checkpoint's weights θ (fp32 params, the setting's compute dtype: fp32 by
default, so the fp32 engine is the on-policy sampler) and never moves. The prompts x_1..x_P are the task's
training batch (step 0, draw 0), the same for every arm. Each arm e draws N responses per prompt from its
engine, y_pj ~ μ_e(·|x_p) with the engine's logprobs; rewards r_pj from the task's reward, group advantages
A_pj as training computes them (`dapo.build_batch`: GRPO, the setting's overlong shaping; no dynamic
sampling, every prompt counts in every arm). For each correction c (a `tis.RolloutCorrectionConfig`) the
gradient goes through training's own code: `Learner.prepare` (old logprobs, the correction's weights w_t and
keep mask) then `Learner.gradient` (update's micro-batch gradient steps, no optimizer step), one prompt's
group at a time:

    g_p^{e,c} = ∇_θ Σ_t ω_t w_t l_t          at fixed θ: old = current, PPO ratio 1, ∇l_t = −A ∇log π_θ(y_t)
    g^{e,c}   = Σ_p n_p g_p / Σ_p n_p         n_p: the group's kept tokens (token-mean; kept sequences for
                                             the seq-mean aggregations, all its sequences for seq-mean-token-
                                             sum-norm): exactly the gradient of one mini-batch of all P groups

    reference  g_ref   = fp32 engine, seed R, no correction        (--seeds R A)
    floor      g_floor = fp32 engine, seed A, no correction        a second, independent on-policy estimate
    arms       g^{e,c} = engine e, seed A, correction c

    cos    = <g, g_ref> / (‖g‖ ‖g_ref‖)            rel_l2 = ‖g − g_ref‖ / ‖g_ref‖      (full gradients, all D dims)
    Δcos   = cos(g^{e,c}) − cos(g_floor)           below 0: further from on-policy than sampling noise puts it
    Δcos vs none = cos(g^{e,c}) − cos(g^{e,none})  what the correction moved
    cos to floor = cos(g^{e,c}, g_floor)           on the sketches: the arm against the estimate drawn with the
                                                   same random numbers (common random numbers, below); 1 where
                                                   the engine and correction change nothing
    excess = rel_l2(g^{e,c})² − rel_l2(g_floor)²   ≈ ‖E g^{e,c} − E g_ref‖² / ‖g_ref‖², the squared bias, since
             E‖g − g_ref‖² = ‖bias‖² + tr Cov(g) + tr Cov(g_ref) and the covariance terms of arm and floor match

Sample j of prompt p gets the engine seed b(s) + p·N + j, b(s) = `rl.rollout.sampling_seed(s, 0, 0)`. Every
arm samples with seed A, as the floor does: vLLM's seeded sampler then draws the same random numbers for
both, so an arm's samples differ from the floor's only where its distribution does (common random numbers),
and Δcos and the excess measure its bias with far less noise than two independent draws would.

Arms: fp32 / bf16 (vLLM unquantized in that dtype), fp8 (`fp8_per_channel`), int8 (`int8_per_channel`, INT8
W8A8 from the adapter's compressed-tensors copy under <out>/quantized), mxfp4 (the `fake_quant` engine:
MXFP4-rounded projections served by an fp32 engine). `<arm>x<f>` (e.g. fp32x0.7) serves arm's engine with
its logits scaled by f, i.e. sampled at temperature T/f; its logprobs are that distribution's, so the
corrections see the true mismatch: a deliberately wrong engine, to check that the measure detects one.
Corrections: none, token_tis (token, C = 2), seq_mask (TRL's sequence mask: sequence IS weight, sequences
above C = 3 masked; gin/recipes/sequence_mask_trl.gin), icepop, sequence_tis (C = 4, gin/recipes/
sequence_tis.gin), or any `tis.PRESETS` name; self-normalised corrections are refused (they normalise over
the batch, which a per-prompt gradient cannot see). `tis/*` columns: `tis.apply_rollout_correction`'s
metrics on the whole batch (the learner's own correction function): kl (k1 of KL(μ ‖ π)), k3_kl, weight_ess,
clipped_frac, token_masked_frac, seq_masked_frac.

Confidence intervals: bootstrap over prompts (B resamples with replacement, the same resample for every
estimate: paired), 2.5 / 97.5 percentiles. A resample repeats some prompts, which shifts cos (a non-linear
statistic) in its own direction, so an interval need not contain the full-gradient point value; read the
intervals as the spread over prompt sets, and Δcos / excess as paired differences. Full per-prompt gradients do not fit (SmolLM2: 135M floats each),
so each n_p g_p is kept only as a k-dimensional count sketch S x, S_i = Σ_{d: h(d)=i} s(d) x_d with a hash h
into k buckets and a random sign s of the coordinate index (seeded, --sketch_seed): linear, and
E <Sx, Sy> = <x, y> (a sparse Johnson-Lindenstrauss projection; error ~ ‖x‖‖y‖/√k). A resample's gradient is
Σ_p S(n_p g_p) / Σ_p n_p in the sketch; the headline cos / rel_l2 are on the full gradients (`cos_sketch`
shows the sketch's own value). Memory: the reference's full gradient plus one arm's at a time (2 × D floats)
and P × k floats per estimate.

Resuming: every draw (rollouts, rewards) and every estimate (per-prompt sketches, n, its row; the reference's
full gradient too) is written to <out>/cache as soon as it exists; the same command again reuses them and
does only what is missing (a SmolLM2 measurement takes hours). A cache made with other settings (checkpoint
files, task, sampling, P, N, seeds, sketch, aggregation) is refused in one line.

Output: <out>/results.json, a markdown table on stdout, and with --plot a figure (cos with its CI per arm
and correction against the floor's band; the excess with its CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engines' INFO lines would bury the table

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BASE_ARMS = ("fp32", "bf16", "fp8", "int8", "mxfp4")
REFERENCE, FLOOR = ("ref", "none"), ("fp32", "none")
# name → RolloutCorrectionConfig fields (any other tis.PRESETS name is taken as that preset)
CORRECTIONS = {
    "none": dict(mode="none"),
    "token_tis": dict(mode="token", clip=2.0),
    "seq_mask": dict(mode="sequence", clip=None, product_mask_high=3.0),
    "icepop": dict(mode="token", clip=5.0, token_mask_low=0.5, token_mask_high=5.0),
    "sequence_tis": dict(mode="sequence", clip=4.0),
}
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
TIS_COLUMNS = ("kl", "k3_kl", "weight_ess", "clipped_frac", "token_masked_frac", "seq_masked_frac")


class BadInput(ValueError):
    """An argument the measurement cannot use; its message is one line."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """A model, task and sampling setup; the loss and memory settings of the recipe it comes from."""
    checkpoint: str
    task: Callable[[], object]      # → a tasks.* task (prompts: train_batch(0, 0, P); reward: task.reward)
    chat_template: bool
    temperature: float
    max_tokens: int
    max_model_len: int
    make_checkpoint: str            # the command that writes `checkpoint`
    engine_init_kwargs: dict = dataclasses.field(default_factory=dict)   # every arm's extra vLLM arguments
    memory: dict = dataclasses.field(default_factory=dict)               # learner_jax.MemoryConfig fields
    loss: dict = dataclasses.field(default_factory=dict)                 # rl.LossConfig fields
    compute_dtype: str = "float32"


def _toy_task():
    from portable_rl.tasks import ArithmeticTask

    return ArithmeticTask(num_digits=2, ops="+", seed=0, num_eval=200)  # gin/warmstart.gin's


def _word_problems():
    from portable_rl.tasks import WordProblemsTask

    return WordProblemsTask(min_ops=1, max_ops=2, max_start=10, max_amount=5, grouped=False, seed=0,
                            num_eval=128)  # gin/recipes/smollm2_arith_fp8.gin's


SETTINGS = {
    # gin/dapo_fp8.gin: the tiny warm-started Qwen2 on 2-digit addition, T = 1, 8 response tokens
    "toy": Setting(checkpoint="checkpoints/arith_warmstart", task=_toy_task, chat_template=False, temperature=1.0,
                   max_tokens=8, max_model_len=64,
                   make_checkpoint="python -m portable_rl.warmstart --gin_file=gin/warmstart.gin",
                   memory=dict(attention_impl="dense", pack_sequences=True),
                   loss=dict(overlong_buffer=2, overlong_penalty=1.0)),
    # gin/recipes/smollm2_arith_fp8.gin: SmolLM2-135M-Instruct on word problems, T = 0.6, 160 response tokens;
    # its learner memory settings (the same gradient, less memory); fp32 compute (see the module doc)
    "smollm2": Setting(checkpoint="checkpoints/smollm2-135m-instruct", task=_word_problems, chat_template=True,
                       temperature=0.6, max_tokens=160, max_model_len=320,
                       make_checkpoint="python -m portable_rl.convert.gguf checkpoints/smollm2-135m-instruct",
                       engine_init_kwargs={"enable_chunked_prefill": False},
                       memory=dict(max_tokens_per_micro_batch=1024, logprob_chunk_tokens=512, remat="full",
                                   attention_impl="blockwise", share_prompts=True),
                       loss=dict(overlong_buffer=0)),
}


# ------------------------------------------------------------------------------------------ arms, corrections
def parse_arm(name: str) -> tuple[str, float]:
    """'fp8' → ('fp8', 1.0); 'fp32x0.7' → ('fp32', 0.7): the base arm and the scale of its logits."""
    base, scale = name, 1.0
    head, sep, tail = name.rpartition("x")
    if sep and head in BASE_ARMS:
        try:
            base, scale = head, float(tail)
        except ValueError:
            pass
    if base not in BASE_ARMS or not (0.0 < scale <= 10.0) or not math.isfinite(scale):
        raise BadInput(f"unknown arm {name!r}; use one of {' '.join(BASE_ARMS)}, or <arm>x<f> with 0 < f <= 10 "
                       "(logits scaled by f, e.g. fp32x0.7)")
    return base, scale


def correction_config(name: str):
    from portable_rl import tis

    if name in CORRECTIONS:
        config = tis.RolloutCorrectionConfig(**CORRECTIONS[name])
    elif name in tis.PRESETS:
        config = tis.RolloutCorrectionConfig.preset(name)
    else:
        raise BadInput(f"unknown correction {name!r}; use one of {' '.join(CORRECTIONS)} or a tis.PRESETS name "
                       f"({' '.join(sorted(set(tis.PRESETS) - set(CORRECTIONS)))})")
    if config.self_normalize:
        raise BadInput(f"correction {name!r} self-normalises over the batch, which per-prompt gradients cannot do")
    return config


def engine_spec(base: str, setting: Setting, workdir: Path) -> tuple[str, dict]:
    """(registry name, create_engine kwargs) of a base arm, as gin/engines/*.gin and the recipes build them."""
    common = dict(max_model_len=setting.max_model_len, seed=0)
    init = dict(setting.engine_init_kwargs)
    if base == "mxfp4":  # gin/engines/fake_quant.gin on an fp32 engine (experiments/fp8_tis_experiment.py's)
        inner = dict(engine_init_kwargs={**init, "quantization": None, "dtype": "float32"}, **common)
        return "fake_quant", dict(engine="vllm", scheme="mxfp4", engine_kwargs=inner)
    if base in ("fp32", "bf16"):
        init.update(quantization=None, dtype="float32" if base == "fp32" else "bfloat16")
    else:
        init["quantization"] = {"fp8": "fp8_per_channel", "int8": "int8_per_channel"}[base]
    return "vllm", dict(engine_init_kwargs=init, quantized_checkpoint_root=str(workdir / "quantized"), **common)


def base_seed(seed: int) -> int:
    from portable_rl.rl.rollout import sampling_seed

    return sampling_seed(seed, 0, 0)


def check_inputs(setting: Setting, checkpoint: str, prompts: int, samples: int, arms, corrections, seeds,
                 sketch_dim: int, bootstrap: int, aggregation: str) -> None:
    """Raises BadInput (one line) for anything the measurement cannot use."""
    if not (Path(checkpoint) / "config.json").exists():
        raise BadInput(f"no HF checkpoint at {checkpoint}; write it with: {setting.make_checkpoint}")
    if prompts < 1:
        raise BadInput(f"--prompts {prompts}: need at least 1 prompt")
    if samples < 2:
        raise BadInput(f"--samples {samples}: group advantages need at least 2 samples per prompt")
    for arm in arms:
        parse_arm(arm)
    for name in corrections:
        correction_config(name)
    if len(seeds) != 2 or seeds[0] == seeds[1]:
        raise BadInput(f"--seeds {' '.join(map(str, seeds))}: give two different seeds, R (the reference) and A "
                       "(the floor and every arm)")
    if abs(base_seed(seeds[0]) - base_seed(seeds[1])) < prompts * samples:
        raise BadInput(f"--seeds {seeds[0]} {seeds[1]}: their engine seed ranges overlap for {prompts} x {samples} "
                       "samples (the draws would not be independent); pick another seed")
    if sketch_dim < 0 or bootstrap < 0:
        raise BadInput(f"--sketch_dim {sketch_dim}, --bootstrap {bootstrap}: must be >= 0")
    if aggregation not in AGGREGATIONS:
        raise BadInput(f"--aggregation {aggregation!r}: use one of {' '.join(AGGREGATIONS)}")


# ------------------------------------------------------------------------------------------ the math
def group_weight(aggregation: str, loss_mask: np.ndarray) -> float:
    """n_p: the group's share of a mini-batch's normaliser (module doc), from its kept-token mask [N, T]."""
    per_seq = (np.asarray(loss_mask) > 0).sum(axis=-1)
    if aggregation == "token-mean":
        return float(per_seq.sum())
    if aggregation == "seq-mean-token-sum-norm":
        return float(len(per_seq))
    return float(np.count_nonzero(per_seq))


def make_sketch(dim: int, k: int, seed: int = 0) -> tuple[Callable[[np.ndarray], np.ndarray], int]:
    """(S, k): the count sketch of the module doc, R^dim → R^k; k = 0 or k >= dim: the identity (k = dim)."""
    if k <= 0 or k >= dim:
        return (lambda x: np.asarray(x, np.float32).copy()), dim
    import jax
    import jax.numpy as jnp

    def mix(h):  # MurmurHash3's 32-bit finaliser: every input bit reaches every output bit
        h = h ^ (h >> 16)
        h = h * jnp.uint32(0x85EBCA6B)
        h = h ^ (h >> 13)
        h = h * jnp.uint32(0xC2B2AE35)
        return h ^ (h >> 16)

    salt = np.uint32((seed * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF)

    @jax.jit
    def sketch(x):
        h = mix(jax.lax.iota(jnp.uint32, dim) ^ salt)
        bucket = (h % jnp.uint32(k)).astype(jnp.int32)
        sign = jnp.where(mix(h ^ jnp.uint32(0x5BD1E995)) >> 31, -1.0, 1.0).astype(jnp.float32)
        return jax.ops.segment_sum(x * sign, bucket, num_segments=k)

    return (lambda x: np.asarray(sketch(jnp.asarray(x, jnp.float32)))), k


def compare(g: np.ndarray, ref: np.ndarray, chunk: int = 1 << 22) -> dict:
    """cos, rel_l2 and the norm ratio of g against ref: float64 sums over float64 chunks (a SmolLM2 gradient
    converted whole would be another 1 GB twice)."""
    gg = rr = gr = dd = 0.0
    for i in range(0, len(g), chunk):
        a, b = np.asarray(g[i:i + chunk], np.float64), np.asarray(ref[i:i + chunk], np.float64)
        gg, rr, gr, dd = gg + a @ a, rr + b @ b, gr + a @ b, dd + (a - b) @ (a - b)
    ng, nr = math.sqrt(gg), math.sqrt(rr)
    cos = gr / (ng * nr) if ng > 0 and nr > 0 else float("nan")
    rel = math.sqrt(dd) / nr if nr > 0 else float("nan")
    return {"cos": float(cos), "rel_l2": float(rel), "norm_ratio": ng / nr if nr > 0 else float("nan")}


def _rowwise(g: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and rel_l2 of each row of g [B, k] against the same row of ref."""
    with np.errstate(invalid="ignore", divide="ignore"):
        nr = np.linalg.norm(ref, axis=1)
        cos = (g * ref).sum(1) / (np.linalg.norm(g, axis=1) * nr)
        rel = np.linalg.norm(g - ref, axis=1) / nr
    return cos, rel


def bootstrap_intervals(sketches: dict, reference, floor, resamples: int, seed: int = 0,
                        level: float = 0.95) -> dict:
    """sketches: (arm, correction) → (U [P, k] = S(n_p g_p) per prompt, n [P]). Paired bootstrap over prompts
    (one resample for every key) → key → {stat_ci: (lo, hi)} for cos and rel_l2 (against the reference's
    resample), dcos (cos − the floor's cos), excess (rel_l2² − the floor's rel_l2²), dcos_none (cos − the
    same arm's cos without correction: what the correction moved) and cos_floor (cos against the floor's
    resample), plus the sketch's own point values."""
    p = next(iter(sketches.values()))[0].shape[0]
    weights = np.ones((1, p))
    if resamples:
        weights = np.vstack([weights, np.random.default_rng(seed).multinomial(p, np.full(p, 1.0 / p), size=resamples)])

    def resampled(key):
        u, n = sketches[key]
        with np.errstate(invalid="ignore", divide="ignore"):
            return (weights @ np.asarray(u, np.float64)) / (weights @ np.asarray(n, np.float64))[:, None]

    def against_ref_and_floor(g):  # one resample of a key at a time: each is [1 + B, k] float64
        return (*_rowwise(g, ref), _rowwise(g, floor_draw)[0])

    ref, floor_draw = resampled(reference), resampled(floor)
    measured = {key: against_ref_and_floor(resampled(key)) for key in sketches}  # → (cos, rel, cos_floor) [1 + B]
    floor_cos, floor_rel, _ = measured[floor]
    tail = 100 * (1 - level) / 2
    out = {}
    for key, (cos, rel, cos_floor) in measured.items():
        stats = {"cos": cos, "rel_l2": rel, "dcos": cos - floor_cos, "excess": rel ** 2 - floor_rel ** 2,
                 "cos_floor": cos_floor}
        if (key[0], "none") in measured:
            stats["dcos_none"] = cos - measured[key[0], "none"][0]
        row = {"cos_sketch": float(cos[0]), "rel_l2_sketch": float(rel[0]), "cos_floor": float(cos_floor[0])}
        for name, values in stats.items():
            boot = values[1:]
            boot = boot[np.isfinite(boot)]
            row[f"{name}_ci"] = ((float(np.percentile(boot, tail)), float(np.percentile(boot, 100 - tail)))
                                 if boot.size else (float("nan"), float("nan")))
        out[key] = row
    return out


# ------------------------------------------------------------------------------------------ sampling, gradients
def draw(engine, codec, examples, reward_fn, setting: Setting, samples: int, seed: int, logit_scale: float):
    """N samples per example from `engine` (logits × logit_scale) → (ScoredGroups, stats)."""
    from portable_rl.engines import SamplingConfig
    from portable_rl.rl.rollout import ScoredGroup, count_nonfinite
    from portable_rl.rl.scoring import generate_and_score

    sampling = SamplingConfig(temperature=setting.temperature / logit_scale, max_tokens=setting.max_tokens,
                              n=samples, seed=base_seed(seed), stop_token_ids=(codec.eos_id,))
    scored = generate_and_score(engine, codec, examples, reward_fn, sampling)
    rewards, n = scored.rewards, samples
    groups = [ScoredGroup(examples[p], scored.rollouts[p * n:(p + 1) * n], rewards[p * n:(p + 1) * n])
              for p in range(len(examples))]
    lengths = [len(r.response_token_ids) for r in scored.rollouts]
    stats = {"reward_mean": float(rewards.mean()),
             "informative_groups": int(sum(np.ptp(g.rewards) > 0 for g in groups)),
             "response_length_mean": float(np.mean(lengths)),
             "truncated_fraction": float(np.mean([r.finish_reason == "length" for r in scored.rollouts])),
             "nonfinite_logprobs": int(sum(count_nonfinite(r.response_logprobs) for r in scored.rollouts))}
    return groups, stats


def _pad_to(a: np.ndarray, width: int) -> np.ndarray:
    return np.pad(a, ((0, 0), (0, width - a.shape[1])))


def estimate(learner, cfg, groups, pad_id: int, sketch, correction):
    """The batch gradient of one (arm, correction) through the learner, one group at a time (module doc)
    → (full gradient [D], per-prompt sketches [P, k], n [P], tis/* of the whole batch, train/* loss metrics)."""
    from portable_rl import tis
    from portable_rl.rl.dapo import build_batch

    full, sketches, weights, views, losses = None, [], [], [], []
    for group in groups:
        batch, _ = build_batch(cfg, [group], pad_id)
        prepared = learner.prepare(batch)
        if prepared.deferred is not None:
            raise ValueError("estimate needs every old logprob in the PreparedBatch: build the learner with "
                             "rl.LossConfig.old_logprobs_from_update=False")
        grad, metrics = learner.gradient(prepared)
        n = group_weight(cfg.loss.loss_aggregation, batch["response_mask"] * prepared.keep_mask)
        grad *= n                                                     # in place: no second [D] temporary
        if full is None:
            full = grad.copy()
        else:
            full += grad
        sketches.append(sketch(grad))
        weights.append(n)
        views.append((prepared.old_logprobs, np.asarray(batch["rollout_logprobs"]), np.asarray(batch["response_mask"])))
        losses.append(metrics.get("train/loss", 0.0))
    total = sum(weights)
    full *= (1.0 / total) if total > 0 else 0.0
    width = max(v[0].shape[1] for v in views)
    old, rollout, mask = (np.concatenate([_pad_to(v[i], width) for v in views]) for i in range(3))
    _, _, tis_metrics = tis.apply_rollout_correction(correction, old, rollout, mask)
    return (full, np.stack(sketches), np.asarray(weights),
            {f"tis/{k}": float(v) for k, v in tis_metrics.items()}, {"train/loss_sum": float(sum(losses))})


# ------------------------------------------------------------------------------------------ the cache
def fingerprint(setting: Setting, checkpoint: str, prompts: int, samples: int, seeds, sketch_dim: int,
                sketch_seed: int, aggregation: str) -> dict:
    """Everything a cached draw or estimate depends on (module doc, "Resuming"), as plain JSON values."""
    weights = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in Path(checkpoint).glob("*.safetensors"))
    return {"checkpoint": str(checkpoint), "weights": [list(w) for w in weights], "task": repr(setting.task()),
            "chat_template": setting.chat_template, "temperature": setting.temperature,
            "max_tokens": setting.max_tokens, "max_model_len": setting.max_model_len,
            "engine_init_kwargs": setting.engine_init_kwargs, "loss": setting.loss,
            "compute_dtype": setting.compute_dtype, "prompts": prompts, "samples": samples, "seeds": list(seeds),
            "sketch_dim": sketch_dim, "sketch_seed": sketch_seed, "aggregation": aggregation}


class Cache:
    """<out>/cache: each draw's rollouts and rewards (JSON), each estimate's per-prompt sketches, n and row (npz),
    the reference's full gradient (npy), all written atomically, so a stopped measurement goes on where it
    stopped. A cache made with other settings (`fingerprint`) is refused, not mixed in."""

    def __init__(self, root: Path, key: dict):
        self.root = root / "cache"
        self.root.mkdir(parents=True, exist_ok=True)
        stamp = self.root / "fingerprint.json"
        text = json.dumps(key, sort_keys=True, indent=1)
        if stamp.exists() and stamp.read_text() != text:
            old = json.loads(stamp.read_text())
            diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
            raise BadInput(f"{self.root} holds a measurement with other settings ({', '.join(diff)}); pass another "
                           "--out, or delete that directory to start over")
        self._write(stamp, lambda f: f.write(text.encode()))

    def _write(self, path: Path, write) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)

    def load_draw(self, arm: str, examples):
        from portable_rl.engines.base import Rollout
        from portable_rl.rl.rollout import ScoredGroup

        path = self.root / f"draw_{arm}.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        groups = [ScoredGroup(examples[p], [Rollout(**r) for r in rollouts], np.asarray(rewards, np.float32))
                  for p, (rollouts, rewards) in enumerate(zip(data["rollouts"], data["rewards"]))]
        return groups, data["stats"]

    def save_draw(self, arm: str, groups, stats: dict) -> None:
        data = {"stats": stats, "rewards": [g.rewards.tolist() for g in groups],
                "rollouts": [[dataclasses.asdict(r) for r in g.rollouts] for g in groups]}
        self._write(self.root / f"draw_{arm}.json", lambda f: f.write(json.dumps(data).encode()))

    def load_estimate(self, key):
        path = self.root / f"estimate_{key[0]}__{key[1]}.npz"
        if not path.exists():
            return None
        with np.load(path) as f:
            return f["sketch"], f["n"], json.loads(str(f["row"]))

    def save_estimate(self, key, sketch, n, row: dict, full=None) -> None:
        if full is not None:
            self._write(self.root / "reference_gradient.npy", lambda f: np.save(f, full))
        self._write(self.root / f"estimate_{key[0]}__{key[1]}.npz",
                    lambda f: np.savez(f, sketch=sketch, n=n, row=np.array(json.dumps(row))))

    def reference_gradient(self) -> np.ndarray:
        return np.load(self.root / "reference_gradient.npy")


# ------------------------------------------------------------------------------------------ the measurement
def measure(setting: Setting, *, prompts: int, samples: int, arms, corrections, seeds, workdir, checkpoint=None,
            sketch_dim: int = 4096, sketch_seed: int = 0, bootstrap: int = 1000, bootstrap_seed: int = 0,
            aggregation: str = "token-mean", floor_corrections: bool = True, log=print) -> dict:
    """Draws every arm, computes every (arm, correction) gradient and compares it with the reference
    (module doc) → the results dict (`rows`: one per arm and correction, the floor first). What <workdir>/cache
    already holds for these settings is reused. `floor_corrections=False`: the fp32 arm without correction only
    (on-policy the corrections are near no-ops; SmolLM2 saves 3 of 17 estimates)."""
    checkpoint = str(checkpoint or setting.checkpoint)
    arms = ["fp32"] + [a for a in arms if a != "fp32"]                    # the floor is the fp32 arm
    corrections = ["none"] + [c for c in corrections if c != "none"]
    check_inputs(setting, checkpoint, prompts, samples, arms, corrections, list(seeds), sketch_dim, bootstrap,
                 aggregation)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    from portable_rl import engines  # before torch: passive OpenMP waits (engines/__init__.py)
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.learner_jax.memory import MemoryConfig
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.learner import Learner
    from portable_rl.tasks import get_reward
    from portable_rl.rl.dapo import dapo_config

    cache = Cache(workdir, fingerprint(setting, checkpoint, prompts, samples, seeds, sketch_dim, sketch_seed,
                                      aggregation))
    task = setting.task()
    examples = task.train_batch(0, 0, prompts)
    reward_fn = get_reward(task.reward)
    codec = TextCodec(checkpoint, chat_template=setting.chat_template)
    # old logprobs recomputed in `prepare` (not deferred to the update's forward: the same gradient), so the
    # PreparedBatch holds every sequence's old logprobs for the batch's tis/* (`estimate`)
    cfg = dapo_config(n_samples=samples, temperature=setting.temperature, max_response_tokens=setting.max_tokens,
                      prompt_batch_size=1, mini_batch_size=1, dynamic_sampling=False, loss_aggregation=aggregation,
                      old_logprobs_from_update=False, **setting.loss)
    configs = {c: correction_config(c) for c in corrections}

    @functools.cache
    def learner_side():
        """(learners per correction, sketch), built only when an estimate is missing from the cache (the model's
        load and compilations): aggregating a finished measurement needs none of it."""
        memory = MemoryConfig(**setting.memory)
        model, _ = load_hf_model(checkpoint, param_dtype=jnp.float32, compute_dtype=jnp.dtype(setting.compute_dtype),
                                 **memory.model_kwargs())
        optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)  # required by Learner, never stepped
        learners = {c: Learner(model, optimizer, cfg, configs[c], memory=memory) for c in corrections}
        dim = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
        sketch, k = make_sketch(dim, sketch_dim, sketch_seed)
        log(f"[gradfid] {checkpoint}: {dim:,} parameters, sketch {k} dims")
        return learners, sketch

    log(f"[gradfid] {prompts} prompts x {samples} samples; arms {' '.join(arms)}; corrections "
        f"{' '.join(corrections)}; cache {cache.root}")

    def wanted(arm):
        return ["none"] if arm == "ref" or (arm == FLOOR[0] and not floor_corrections) else corrections

    # (draw name, base arm, logit scale, seed): the reference first, on the fp32 engine
    draws = [("ref", "fp32", 1.0, seeds[0])] + [(a, *parse_arm(a), seeds[1]) for a in arms]
    bases = list(dict.fromkeys(base for _, base, _, _ in draws))
    ref_full, sketches, rows, draw_stats = None, {}, {}, {}
    for base in bases:  # one engine at a time, closed before its draws' gradients
        mine = [d for d in draws if d[1] == base]
        drawn = {}
        for arm, *_ in mine:
            cached = cache.load_draw(arm, examples)
            if cached is not None:
                drawn[arm], draw_stats[arm] = cached
        todo = [d for d in mine if d[0] not in drawn]
        needed = [d for d in mine if any(cache.load_estimate((d[0], c)) is None for c in wanted(d[0]))]
        if todo and needed:
            name, kwargs = engine_spec(base, setting, workdir)
            t0 = time.perf_counter()
            engine = engines.create_engine(name, model_path=checkpoint, **kwargs)
            started = time.perf_counter() - t0
            try:
                for arm, _, scale, seed in todo:
                    t0 = time.perf_counter()
                    drawn[arm], stats = draw(engine, codec, examples, reward_fn, setting, samples, seed, scale)
                    stats.update(engine=f"{name} {kwargs.get('engine_init_kwargs', kwargs.get('engine_kwargs'))}",
                                 engine_start_s=started / len(todo), generate_s=time.perf_counter() - t0, seed=seed,
                                 logit_scale=scale, quantization=engine.quantization)
                    draw_stats[arm] = stats
                    cache.save_draw(arm, drawn[arm], stats)
                    log(f"[gradfid] {arm}: drawn in {stats['generate_s']:.1f} s (engine start {started:.1f} s), "
                        f"reward {stats['reward_mean']:.3f}, {stats['informative_groups']}/{prompts} informative "
                        f"groups, {stats['response_length_mean']:.1f} tokens")
            finally:
                engine.close()
        for arm, *_ in mine:
            for correction in wanted(arm):
                key = (arm, correction)
                cached = cache.load_estimate(key)
                if cached is not None:
                    per_prompt, n, rows[key] = cached
                    sketches[key] = (per_prompt, n)
                    continue
                if arm not in drawn:
                    raise RuntimeError(f"no draw of {arm} in {cache.root} and none made")  # cannot happen
                if ref_full is None and arm != "ref":
                    ref_full = cache.reference_gradient()
                t0 = time.perf_counter()
                learners, sketch = learner_side()
                full, per_prompt, n, tis_metrics, loss = estimate(learners[correction], cfg, drawn[arm],
                                                                  codec.pad_id, sketch, configs[correction])
                if arm == "ref":
                    ref_full = full
                sketches[key] = (per_prompt, n)
                rows[key] = {"arm": arm, "correction": correction, **compare(full, ref_full),
                             "grad_norm": float(np.linalg.norm(full)), **tis_metrics, **loss,
                             "gradient_s": time.perf_counter() - t0}
                cache.save_estimate(key, per_prompt, n, rows[key], full=full if arm == "ref" else None)
                del full
                log(f"[gradfid] {arm} / {correction}: cos {rows[key]['cos']:.4f}, rel_l2 {rows[key]['rel_l2']:.4f}, "
                    f"tis/kl {tis_metrics['tis/kl']:+.4f} ({rows[key]['gradient_s']:.1f} s)")
    for arm in draw_stats:
        draw_stats[arm]["gradients_s"] = sum(r["gradient_s"] for (a, _), r in rows.items() if a == arm)
    intervals = bootstrap_intervals(sketches, REFERENCE, FLOOR, bootstrap, bootstrap_seed)
    floor = rows[FLOOR]
    ordered = []
    for key in [FLOOR] + [k for k in rows if k not in (FLOOR, REFERENCE)]:
        row = {**rows[key], **intervals[key]}
        row["dcos"] = row["cos"] - floor["cos"]
        row["excess"] = row["rel_l2"] ** 2 - floor["rel_l2"] ** 2
        row["dcos_none"] = row["cos"] - rows[key[0], "none"]["cos"]
        ordered.append(row)
    dim = int(np.load(cache.root / "reference_gradient.npy", mmap_mode="r").shape[0])
    k = next(iter(sketches.values()))[0].shape[1]
    return {"checkpoint": checkpoint, "parameters": dim, "sketch_dim": k, "sketch_seed": sketch_seed,
            "prompts": prompts, "samples": samples, "seeds": list(seeds), "aggregation": aggregation,
            "bootstrap": bootstrap, "bootstrap_seed": bootstrap_seed, "temperature": setting.temperature,
            "max_tokens": setting.max_tokens, "compute_dtype": setting.compute_dtype,
            "floor": {"cos": floor["cos"], "rel_l2": floor["rel_l2"], "cos_ci": intervals[FLOOR]["cos_ci"],
                      "rel_l2_ci": intervals[FLOOR]["rel_l2_ci"],
                      "samples_per_prompt_for_cos": samples_for_cos(floor["cos"], samples)},
            "draws": draw_stats, "rows": ordered}


def samples_for_cos(floor_cos: float, samples: int, targets=(0.5, 0.9, 0.99)) -> dict:
    """Samples per prompt at which two on-policy estimates would agree to cos c*, from the floor measured
    with `samples`: each estimate is the mean gradient μ plus noise of covariance Σ / N, so
    E cos ≈ r / (1 + r) with r = N ‖μ‖² / tr Σ; r = c / (1 − c) at the measured c, and N* = N · (c* / (1 − c*)) / r.
    {} when the floor is not in (0, 1) (no signal to extrapolate)."""
    if not 0.0 < floor_cos < 1.0:
        return {}
    r = floor_cos / (1.0 - floor_cos)
    return {str(c): math.ceil(samples * (c / (1.0 - c)) / r) for c in targets}


# ------------------------------------------------------------------------------------------ report
def _ci(row, name, fmt="{:.3f}"):
    lo, hi = row[f"{name}_ci"]
    return f"{fmt.format(row[name])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def markdown(results: dict) -> str:
    lines = ["| arm | correction | cos to ref [95% CI] | rel L2 [95% CI] | Δcos vs floor [95% CI] | excess rel L2² "
             "[95% CI] | Δcos vs none [95% CI] | cos to floor (sketch) [95% CI] | ‖g‖/‖g_ref‖ | tis/kl | tis/k3_kl "
             "| ESS | clipped | masked tok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        floor = (row["arm"], row["correction"]) == FLOOR
        lines.append("| " + " | ".join([
            row["arm"] + (" (floor)" if floor else ""), row["correction"], _ci(row, "cos"), _ci(row, "rel_l2"),
            "—" if floor else _ci(row, "dcos", "{:+.3f}"), "—" if floor else _ci(row, "excess", "{:+.3f}"),
            "—" if row["correction"] == "none" else _ci(row, "dcos_none", "{:+.3f}"),
            "—" if floor else _ci(row, "cos_floor"), f"{row['norm_ratio']:.3f}", f"{row['tis/kl']:+.4f}", f"{row['tis/k3_kl']:.4f}",
            f"{row['tis/weight_ess']:.3f}", f"{row['tis/clipped_frac']:.3f}", f"{row['tis/token_masked_frac']:.3f}",
        ]) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the floor arm under a correction is the floor again (weights 1 on-policy): the table shows it, the plot not
    rows = [r for r in results["rows"] if r["arm"] != FLOOR[0] or r["correction"] == FLOOR[1]]
    corrections = list(dict.fromkeys(r["correction"] for r in rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    colors = dict(zip(corrections, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 2), sharey=True)
    labels, positions, y, legend = [], [], 0.0, set()
    for arm in arms:
        for c in corrections:
            row = next((r for r in rows if r["arm"] == arm and r["correction"] == c), None)
            if row is None:
                continue
            for ax, name in zip(axes, ("cos", "excess")):
                lo, hi = row[f"{name}_ci"]
                ax.errorbar(row[name], y, xerr=[[max(row[name] - lo, 0)], [max(hi - row[name], 0)]], fmt="o",
                            color=colors[c], capsize=3, label=None if c in legend else c)
            legend.add(c)
            labels.append("floor: fp32 / none" if (arm, c) == FLOOR else f"{arm} / {c}")
            positions.append(y)
            y += 1
        y += 0.5
    lo, hi = results["floor"]["cos_ci"]
    axes[0].axvspan(lo, hi, color="grey", alpha=0.2, label="floor 95% CI")
    axes[0].axvline(results["floor"]["cos"], color="grey", lw=1)
    axes[1].axvline(0.0, color="grey", lw=1)
    axes[1].set_xscale("symlog", linthresh=0.1)
    axes[0].set_yticks(positions, labels)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("cosine to the on-policy reference gradient")
    axes[1].set_xlabel("excess rel. L2² over the floor (≈ squared bias / ‖g_ref‖²)")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"Gradient fidelity: {results['prompts']} prompts x {results['samples']} samples, "
                 f"{Path(results['checkpoint']).name}, seeds {results['seeds'][0]} (reference) / "
                 f"{results['seeds'][1]} (floor and arms)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", default="toy", choices=list(SETTINGS))
    p.add_argument("--checkpoint", default=None, help="HF checkpoint directory (default: the setting's)")
    p.add_argument("--prompts", type=int, default=16, help="P: the task's training prompts (step 0, draw 0)")
    p.add_argument("--samples", type=int, default=64, help="N: samples per prompt per arm")
    p.add_argument("--arms", nargs="+", default=["fp32", "bf16", "fp8", "int8", "mxfp4"],
                   help=f"of {' '.join(BASE_ARMS)}, or <arm>x<f> (logits scaled by f); fp32 (the floor) is always in")
    p.add_argument("--corrections", nargs="+", default=["none", "token_tis", "seq_mask", "icepop"],
                   help=f"of {' '.join(CORRECTIONS)} or a tis.PRESETS name; none is always in")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="R A: the reference's seed, then every arm's")
    p.add_argument("--aggregation", default="token-mean", help=f"the loss aggregation: {' '.join(AGGREGATIONS)}")
    p.add_argument("--sketch_dim", type=int, default=4096, help="k of the bootstrap's count sketch (0: none)")
    p.add_argument("--sketch_seed", type=int, default=0)
    p.add_argument("--bootstrap", type=int, default=1000, help="resamples of the prompts")
    p.add_argument("--bootstrap_seed", type=int, default=0)
    p.add_argument("--floor_corrections", action=argparse.BooleanOptionalAction, default=True,
                   help="also the fp32 arm under each correction (near no-ops on-policy; --no-floor_corrections saves "
                        "their gradients)")
    p.add_argument("--out", default=None, help="results.json (and the INT8 copy) go here; default runs/gradient_fidelity/<setting>")
    p.add_argument("--plot", default=None, help="write the figure here (e.g. docs/img/gradient_fidelity_toy.png)")
    args = p.parse_args(argv)
    setting = SETTINGS[args.setting]
    out = Path(args.out or REPO / "runs" / "gradient_fidelity" / args.setting)
    checkpoint = args.checkpoint or str(REPO / setting.checkpoint)
    start = time.perf_counter()
    try:
        results = measure(setting, prompts=args.prompts, samples=args.samples, arms=args.arms,
                          corrections=args.corrections, seeds=args.seeds, workdir=out, checkpoint=checkpoint,
                          sketch_dim=args.sketch_dim, sketch_seed=args.sketch_seed, bootstrap=args.bootstrap,
                          bootstrap_seed=args.bootstrap_seed, aggregation=args.aggregation,
                          floor_corrections=args.floor_corrections,
                          log=lambda m: print(m, file=sys.stderr, flush=True))
    except BadInput as e:
        raise SystemExit(f"error: {e}") from None
    results.update(setting=args.setting, command=" ".join(["python -m experiments.gradient_fidelity"] + sys.argv[1:]),
                   commit=_commit(), cpu=_cpu(), seconds=time.perf_counter() - start,
                   date=time.strftime("%Y-%m-%d"))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"\n{results['parameters']:,} parameters; floor cos {results['floor']['cos']:.3f}; "
          f"{results['seconds']:.0f} s on {results['cpu']}; {out / 'results.json'}")
    if args.plot:
        print(f"plot: {plot(results, Path(args.plot))}")


if __name__ == "__main__":
    main()
