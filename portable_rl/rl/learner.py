"""The learner side of one RL step: old logprobs, rollout correction, mini-batch updates (rl/sync.py pushes weights).

    prepared = learner.prepare(batch)        old logprobs, rollout correction, micro-batches (+ tis/*, batch/*)
    metrics = learner.update(prepared)       the mini-batch updates (train/*)

`prepare(batch)` is pure in the batch (it reads the current policy, writes nothing) and returns a
`PreparedBatch`; `update(prepared)` runs the optimizer. The one order between them is explicit and
checked: a decoupled PreparedBatch holds the logprobs of the policy it was prepared on, so `update`
refuses it once any update has run since (it would be stale; a second use is such a case).

policy_loss_mode="decoupled" (default; verl rollout_correction.bypass_mode=False):
    old_t          = log_softmax(π_θ_old(x_<t) / T)[x_t]        recomputed by the Flax policy (fp32)
    w_t, keep_t    = tis.apply_rollout_correction(cfg, old, rollout, response_mask)
    loss           = Σ_t ω_t · w_t · l_t  over the mini-batch's tokens                  per mini-batch
    ω_t            = losses.loss_token_weights(response_mask · keep, aggregation)  from the whole mini-batch
policy_loss_mode="bypass" (verl bypass_mode=True with loss_type="ppo_clip"):
    old_t          = rollout_t                                   no recompute: no forward pass in prepare
    w_t = 1, keep_t = 1                                          the PPO ratio π_θ / π_rollout, clipped, IS
    loss           = Σ_t ω_t · l_t,  ω_t from response_mask      the correction; weights on top would count it twice
    A rollout correction that does anything (`RolloutCorrectionConfig.enabled`) is a ConfigError here:
    its weights and masks are functions of π_old / π_rollout, which bypass defines to be 1.

Layout (`memory.MemoryConfig`): the batch from `dapo.build_batch` is the per-sequence view [N, T]
(one sequence per row). Each mini-batch (`mini_batch_size` prompt groups) becomes micro-batches that
all have one shape [rows, L]:

    max_tokens_per_micro_batch = M, pack_sequences    sequences first-fit decreasing into rows of M
                                                      tokens; `batch_shards` rows per micro-batch
                                     + share_prompts  the same with each prompt's sequences as shared-
                                                      prompt units (`batching.shared_prompt_packed`)
    max_tokens_per_micro_batch = M, not packed        one sequence per row, L = min(T, M),
                                                      batch_shards · ⌊M / L⌋ rows per micro-batch
    None, pack_sequences                              one micro-batch: rows of the longest sequence
                                                      (`batching.packed_row_length`), `round_rows` rows
                                     + share_prompts  the same with shared-prompt units, rows of the
                                                      longest prompt group
    None, not packed                                  one micro-batch: the view's rows (today's layout)

Old logprobs are computed on exactly these micro-batches and scattered back into the view, where the
(unchanged) rollout correction runs per sequence; its weights / keep mask and the loss weights ω are
gathered back into each micro-batch. Gradients of the micro-batches are summed (`step.make_grad_step`)
and the optimizer runs once per mini-batch (`step.make_apply_step`); with one micro-batch the fused
`step.make_train_step` runs instead. Since ω comes from the whole mini-batch, every layout computes the
same update (tests/test_micro_batches.py, tests/test_memory_equivalence.py).

Deferred first mini-batch (`LossConfig.old_logprobs_from_update`, decoupled, token-local correction): no update
has run when the first non-empty mini-batch trains, so its old logprobs are its update's own forward pass, and
`prepare` skips that mini-batch's forward (verl's `on_policy` shortcut):

    old_t = stop_gradient(new_t),  ratio_t = 1,  w_t = tis.apply_rollout_correction(cfg, old, rollout)_t

Why that is the same update, when it applies, and its lifecycle from `prepare` through the loss to `update` /
`gradient`: `DeferredMiniBatch`.

Served weights (`rl.PrecisionConfig.learner_precision = 'engine'`, `serve_weights_as(quantization)`): every forward
above (old logprobs, the deferred mini-batch's, the loss) runs on `served_view.served_view(model, quantization)`, the
projections as the engine serves them, with straight-through gradients to the masters in the loss. The default
('master') jits exactly the functions it did before.

Routing replay (mixture-of-experts policies, `routing='replay'`, rl.PrecisionConfig.routing): the batch's
`routed_experts` [N, T, S, K] (the engine's experts per position and sparse layer, -1: none; batching.py) travel
in every micro-batch, and every forward above (old logprobs, the deferred mini-batch's, the loss) routes each
token to them instead of its own top-k, gate weights from its own router (learner_jax/moe.py). With
`compare_routing`, `prepare` also scores the step under the other routing, one forward-only pass, and reports

    moe/routing_agreement    share of (token, layer) pairs, over the positions the engine routed, where the
                             learner's own top-k set (its own-routing forward) equals the engine's
    tis/kl_own_routing       tis/kl of the learner's own routing (with replay; tis/kl is the replayed one)
    tis/kl_replayed_routing  tis/kl of the engine's routing replayed (without replay; tis/kl is the own one)

With `routing='own'` and `compare_routing`, the first mini-batch is not deferred (its own-routing forward gives
the agreement). The post-sync probe (`logprobs`) routes with the learner's own router.

With a `mesh` (learner_jax/sharding.py) the model and optimizer state are sharded over it once, and
every micro-batch is split by rows over ("data", "fsdp"); ω is global, so the sum over shards is the
mini-batch loss. Batches come in and metrics / logprobs go out as host numpy arrays.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from portable_rl import tis
from portable_rl.errors import ConfigError
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.moe import load_balancing_loss
from portable_rl.learner_jax.losses import loss_token_weights, policy_loss
from portable_rl.learner_jax.memory import MemoryConfig
from portable_rl.learner_jax.quantize import SERVED_WEIGHTS
from portable_rl.learner_jax.sharding import batch_shards, pad_rows, shard_batch, shard_model_and_optimizer, to_host
from portable_rl.learner_jax.step import make_apply_step, make_grad_step, make_train_step, zero_grads
from portable_rl.rl import batching
from portable_rl.rl.batching import MicroBatchBudgetError
from portable_rl.rl.served_view import served_view

_VIEW_KEYS = ("input_ids", "response_mask", "rollout_logprobs", "advantages")
_SUPPORT = "sampling_support"  # [N, T, K] with truncated sampling (batching.pack_rollouts), else absent
_ROUTED = "routed_experts"     # [N, T, S, K] the engine's routing (batching.pack_rollouts), else absent
_FORWARD_KEYS = ("input_ids", "segment_ids", "positions", _SUPPORT)  # what a logprob forward reads (+ _ROUTED)


def _view(batch: dict) -> dict:
    """The per-sequence arrays the layouts move into rows: _VIEW_KEYS, and the sampling support and the
    engine's routing if any."""
    return {k: batch[k] for k in _VIEW_KEYS + tuple(k for k in (_SUPPORT, _ROUTED) if k in batch)}


def _sequences(layouts: list[batching.Layout]) -> np.ndarray:
    """The view rows a mini-batch's micro-batches hold, each once, in order."""
    return np.unique(np.concatenate([lay.seq for lay in layouts]))


# policy_loss metrics are means over the loss mask (combined over micro-batches weighted by their tokens),
# except these, combined as a max
_MAX_METRICS = ("ratio_max",)


def row_logprobs(model, batch, temperature: float, chunk_tokens=None, return_routing=False):
    """(logp, entropy) [R, L] of rows that may pack several sequences (`segment_ids` / `positions`); with a
    `sampling_support` [R, L, K], logp is renormalised over each token's support (learner_jax/logprobs.py).
    `routed_experts` [R, L, S, K] in the batch: routing replay (learner_jax/moe.py). `return_routing`: (logp,
    entropy, the MoE layers' `Routing`)."""
    return sequence_logprobs(model, batch["input_ids"], None, temperature, segment_ids=batch["segment_ids"],
                             positions=batch["positions"], chunk_tokens=chunk_tokens,
                             sampling_support=batch.get(_SUPPORT), routed_experts=batch.get(_ROUTED),
                             return_routing=return_routing)


def _require_routing(batch: dict) -> None:
    if _ROUTED not in batch:
        raise ConfigError("routing replay / compare_routing but the batch has no routed_experts: start the engine "
                          "with return_routed_experts=True (vLLM) so its rollouts carry them")


def own_routing_scores(model, batch, engine_experts, temperature: float, chunk_tokens=None):
    """The own-routing forward of rows (`batch` without routed_experts) and its agreement with the engine's
    routing `engine_experts` [R, L, S, K] (-1: none) → (logp [R, L], agreeing (token, layer) pairs, pairs
    compared): a pair agrees when the learner's own top-k set equals the engine's."""
    logp, _, routing = row_logprobs(model, batch, temperature, chunk_tokens, return_routing=True)
    own = routing.experts                                                            # [S, R·L, K]
    S, N, K = own.shape
    engine = jnp.swapaxes(engine_experts.reshape(N, S, K), 0, 1).astype(own.dtype)   # [S, R·L, K]
    routed = jnp.all(engine >= 0, axis=-1) & (batch["segment_ids"].reshape(1, N) > 0)  # [S, R·L]
    same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(engine, axis=-1), axis=-1)       # [S, R·L]
    return logp, jnp.sum(same & routed), jnp.sum(routed)


@dataclasses.dataclass(frozen=True)
class DeferredMiniBatch:
    """The first non-empty mini-batch of a step, whose old logprobs and TIS weights its own update computes
    (`LossConfig.old_logprobs_from_update`; module doc).

    Why: `update` trains the mini-batches in order, and refuses a PreparedBatch once any update ran since its
    `prepare`, so when the first non-empty mini-batch's loss runs its forward the weights are still the ones
    `prepare` would score with. Its old logprobs are that forward, stop-gradient (ratio 1): `prepare` saves one
    forward per micro-batch of it, and the update, weights and metrics equal recomputing's to fp32 tolerance
    (tests/test_learner_step.py). Later mini-batches train after an update and keep `prepare`'s forward.
    When: decoupled mode (bypass has no forward to save); a token-local correction
    (`RolloutCorrectionConfig.token_local`: w_t needs only token t and keep = the response mask, so the loss
    weights ω are known before the forward); and not own routing with `compare_routing` (that forward also
    gives the agreement). `Learner.defers_first_mini_batch` says whether a learner defers.

    Its lifecycle:
      create    `first` (in `Learner.prepare`): the first non-empty mini-batch of the layouts, or None.
      prepare   `prepare` runs no forward on it (`index`), so its view rows of old logprobs are 0, and leaves the
                correction's `tis/*` metrics to `complete`; `leave_out` then hands the PreparedBatch on with its
                view rows of the TIS weights 0 and its micro-batches without KEYS (`strip`).
      consume   `in_loss` (in `make_loss_fn`'s loss, inside the jitted step): a micro-batch without KEYS computes
                them from its own forward and returns them [R, L] among the loss outputs. The branch is on the
                micro-batch's keys, so it is decided when jit traces: one jitted step serves both kinds.
      release   `complete` (in `Learner.update` and `Learner.gradient`, after its micro-batches' forward): pops
                KEYS from their outputs and returns a new PreparedBatch with them written in, `deferred` None and
                the `tis/*` metrics of the whole view: what `prepare` returns when it recomputes. The one given
                is not modified; `update`'s later ppo_epochs passes train on the new one."""
    index: int                           # in PreparedBatch.micro_batches
    layouts: list[batching.Layout]       # of its micro-batches
    rollout_logprobs: np.ndarray         # [N, T] of the view
    response_mask: np.ndarray            # [N, T]
    turn_index: np.ndarray | None        # [N, T] for multi-turn trajectories (batching.pack_rollouts), else None

    KEYS = ("old_logprobs", "tis_weights")  # what its update computes: [R, L] arrays

    @classmethod
    def first(cls, batch: dict, layouts: list[list[batching.Layout]]) -> DeferredMiniBatch | None:
        """create: the first mini-batch of `layouts` (per mini-batch, its micro-batches' Layouts) that holds a
        sequence, with the views of `batch` that `complete` corrects; None when every one is empty."""
        index = next((i for i, mini in enumerate(layouts) if mini), None)
        if index is None:
            return None
        return cls(index, layouts[index], batch["rollout_logprobs"], batch["response_mask"], batch.get("turn_index"))

    @classmethod
    def strip(cls, micro_batch: dict) -> dict:
        """One of its micro-batches as `prepare` hands it on: without the arrays the update computes."""
        return {k: v for k, v in micro_batch.items() if k not in cls.KEYS}

    def leave_out(self, prepared: PreparedBatch) -> PreparedBatch:
        """prepare: `prepared` (scored without this mini-batch's forward) with its view rows of the TIS weights 0
        and its micro-batches stripped of KEYS, `deferred` = self. `prepared` is not modified."""
        weights = prepared.tis_weights.copy()                                                 # [N, T]
        weights[_sequences(self.layouts)] = 0.0
        micro = list(prepared.micro_batches)
        micro[self.index] = [self.strip(mb) for mb in micro[self.index]]
        return dataclasses.replace(prepared, micro_batches=micro, tis_weights=weights, deferred=self)

    @staticmethod
    def in_loss(micro_batch: dict, new_logp, correction: tis.RolloutCorrectionConfig) -> tuple[dict, dict]:
        """consume, traced in the loss: a micro-batch without KEYS (one of its micro-batches) → (the micro-batch with
        old = stop_gradient(new_logp) on the response mask and w = its `correction` weights, {those two [R, L]}:
        the loss returns them among its outputs for `complete`); any other micro-batch → (itself, {})."""
        if "old_logprobs" in micro_batch:
            return micro_batch, {}
        old = jax.lax.stop_gradient(new_logp) * micro_batch["response_mask"]                  # [R, L]
        weights, _, _ = tis.apply_rollout_correction(correction, old, micro_batch["rollout_logprobs"],
                                                     micro_batch["response_mask"])
        computed = {"old_logprobs": old, "tis_weights": weights}
        return dict(micro_batch, **computed), computed

    def complete(self, prepared: PreparedBatch, outputs: list[dict],
                 correction: tis.RolloutCorrectionConfig) -> PreparedBatch:
        """release: `prepared` (whose `deferred` this is) with the KEYS popped from `outputs` (per micro-batch of
        this mini-batch, its loss outputs; what stays there are the update's metrics) written into this
        mini-batch's micro-batches and views, `deferred` None, and the `tis/*` metrics of the whole view added;
        what `prepare` returns when it recomputes. `prepared` is not modified."""
        rows = [{k: to_host(out.pop(k)) for k in self.KEYS} for out in outputs]
        old, weights = prepared.old_logprobs.copy(), prepared.tis_weights.copy()            # [N, T]
        for layout, r in zip(self.layouts, rows):
            layout.to_view(r["old_logprobs"], old)
            layout.to_view(r["tis_weights"], weights)
        _, _, metrics = _correction_fn(correction)(old, self.rollout_logprobs, self.response_mask)
        micro = list(prepared.micro_batches)
        micro[self.index] = [dict(mb, **r) for mb, r in zip(micro[self.index], rows)]
        return dataclasses.replace(
            prepared, micro_batches=micro, old_logprobs=old, tis_weights=weights, deferred=None,
            metrics={**prepared.metrics, **{f"tis/{k}": float(v) for k, v in metrics.items()},
                     **turn_metrics(old, self.rollout_logprobs, self.response_mask, self.turn_index)})


def make_loss_fn(cfg, temperature: float, chunk_tokens=None, correction=None, model_view=None):
    """Loss of one micro-batch: Σ ω·w·l (ω = `token_weights`: the aggregation, from the whole mini-batch),
    and metric SUMS over its tokens (`combine_metrics` divides). Uses only cfg's clip / mode settings and
    `router_aux_loss_coef` c: with c > 0 (MoE policies) every loss token's term gains c · the micro-batch's
    load-balancing loss (moe.py), i.e. the loss gains c · aux · Σ ω over the micro-batch's loss tokens.
    `model_view(model)`: the model the forward runs (the served view, `Learner.serve_weights_as`); None: `model`.

    A micro-batch of the deferred mini-batch (no `old_logprobs`) takes them and its TIS weights (`correction`,
    token-local) from this forward and returns them among the outputs: `DeferredMiniBatch.in_loss`."""
    def loss_fn(model, batch):
        if model_view is not None:
            model = model_view(model)
        aux_coef = cfg.router_aux_loss_coef
        if aux_coef:
            new_logp, entropy, routing = row_logprobs(model, batch, temperature, chunk_tokens, return_routing=True)
        else:
            new_logp, entropy = row_logprobs(model, batch, temperature, chunk_tokens)
        batch, deferred = DeferredMiniBatch.in_loss(batch, new_logp, correction)
        mask = batch["response_mask"] * batch["keep_mask"]                          # [R, L]
        loss, metrics = policy_loss(
            new_logp, batch["old_logprobs"], batch["advantages"], mask,
            rollout_logprobs=batch["rollout_logprobs"],
            # bypass: the ratio π_θ / π_rollout is the IS correction; no weight on top (module doc)
            correction_weights=None if cfg.policy_loss_mode == "bypass" else batch["tis_weights"],
            clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, dual_clip_c=cfg.dual_clip_c,
            mode=cfg.policy_loss_mode, token_weights=batch["token_weights"])
        tokens = (mask > 0).sum().astype(jnp.float32)
        if aux_coef:
            aux = load_balancing_loss(routing.logits, model.config.num_experts_per_tok,
                                      (batch["segment_ids"] > 0).reshape(-1))
            loss = loss + aux_coef * aux * jnp.sum(batch["token_weights"] * mask)
            metrics = dict(metrics, router_aux_loss=aux)
        sums = {k: v if k in _MAX_METRICS else v * tokens for k, v in metrics.items()}
        valid = batch["response_mask"] > 0
        sums.update(entropy=jnp.where(valid, entropy, 0.0).sum(), entropy_tokens=valid.sum().astype(jnp.float32),
                    tokens=tokens, **deferred)
        return loss, sums
    return loss_fn


_LossSettings = collections.namedtuple("_LossSettings", "clip_eps_low clip_eps_high dual_clip_c policy_loss_mode "
                                                       "router_aux_loss_coef", defaults=(0.0,))


MASTER = "master"  # `_jitted`'s `served`: the learner's own weights (rl.PrecisionConfig.learner_precision)


@functools.lru_cache(maxsize=8)
def _jitted(settings: _LossSettings, temperature: float, chunk_tokens, correction, served=MASTER, by_layer=False):
    """The learner's jitted functions, shared by learners whose loss settings agree (the aggregation is
    host-side, in the token weights), so a second learner of the same model reuses the compilations.
    `served`: MASTER, or the engine's `quantization` whose served weights the forwards use (`serve_weights_as`).
    `by_layer`: the optimizer update one layer at a time (`MemoryConfig.update_by_layer`)."""
    if served == MASTER:
        view = ste_view = None
    else:
        view = functools.partial(served_view, quantization=served)
        ste_view = functools.partial(served_view, quantization=served, straight_through=True)
    on = (lambda m: m) if view is None else view
    loss_fn = make_loss_fn(settings, temperature, chunk_tokens, correction, model_view=ste_view)
    return dict(
        # read-only: graph_updates=False returns the logprobs, not a copy of the params (learner_jax/step.py)
        logprobs=nnx.jit(lambda m, ids, am: sequence_logprobs(on(m), ids, am, temperature,
                                                              chunk_tokens=chunk_tokens)[0], graph_updates=False),
        row_logprobs=nnx.jit(lambda m, b: row_logprobs(on(m), b, temperature, chunk_tokens)[0],
                             graph_updates=False),
        own_routing_scores=nnx.jit(lambda m, b, e: own_routing_scores(on(m), b, e, temperature, chunk_tokens),
                                   graph_updates=False),
        train_step=make_train_step(loss_fn), grad_step=make_grad_step(loss_fn), apply_step=make_apply_step(by_layer))


@functools.lru_cache(maxsize=8)
def _correction_fn(correction: tis.RolloutCorrectionConfig):
    """jitted `tis.apply_rollout_correction(correction, old, rollout, mask)`: one compilation per config."""
    return jax.jit(functools.partial(tis.apply_rollout_correction, correction))


def turn_metrics(old: np.ndarray, rollout: np.ndarray, mask: np.ndarray, turn_index: np.ndarray | None) -> dict:
    """`tis/kl/turn_<k>`: tis/kl (mean of rollout − old logprob over model tokens) over the tokens of turn k, for
    a batch of multi-turn trajectories (`turn_index` [N, T] from `batching.pack_rollouts`); {} otherwise."""
    if turn_index is None or not turn_index.any():
        return {}
    valid = np.asarray(mask) > 0                                                          # [N, T]
    diff = np.asarray(rollout, np.float64) - np.asarray(old, np.float64)                  # [N, T]
    return {f"tis/kl/turn_{k}": float(diff[valid & (turn_index == k)].mean()) for k in np.unique(turn_index[valid])}


def combine_metrics(parts: list[dict]) -> dict:
    """Micro-batch metric sums → one value per update: token-weighted means, ratio_max a max, loss a sum."""
    tokens = sum(p["tokens"] for p in parts)
    out = {"loss": sum(p["loss"] for p in parts),
           "entropy": sum(p["entropy"] for p in parts) / max(sum(p["entropy_tokens"] for p in parts), 1.0)}
    for k in parts[0]:
        if k in ("loss", "entropy", "entropy_tokens", "tokens", "grad_norm", "learning_rate"):
            continue
        if k in _MAX_METRICS:
            out[k] = max((p[k] for p in parts if p["tokens"] > 0), default=0.0)
        else:
            out[k] = sum(p[k] for p in parts) / max(tokens, 1.0)
    return out


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """What `Learner.prepare` hands `Learner.update`: per mini-batch its micro-batches (host arrays incl.
    old_logprobs, tis_weights, keep_mask, token_weights), the per-sequence views [N, T] of the
    correction, and the `tis/*` + `batch/*` metrics. `policy_version`: the learner's update count when
    the old logprobs were computed (None in bypass: they are the rollout's, of no learner policy).
    `deferred`: the mini-batch whose update computes its old logprobs and TIS weights (`DeferredMiniBatch`:
    its micro-batches lack them, its view rows are 0, and the correction's `tis/*` metrics come with
    `DeferredMiniBatch.complete`); None: all computed here."""
    micro_batches: list[list[dict]]
    old_logprobs: np.ndarray
    tis_weights: np.ndarray
    keep_mask: np.ndarray
    metrics: dict
    policy_version: int | None = None
    deferred: DeferredMiniBatch | None = None


# ------------------------------------------------------------------------------ micro-batch layouts
# One function per row of the module doc's layout table: the sequences `seq` (view rows, none empty) of one
# mini-batch, of lengths `lens` → the Layouts of its micro-batches, all of one shape. Learner.micro_layouts
# picks one.

def _packed_in_budget(seq, lens, *, budget, shards):
    """First-fit decreasing into rows of `budget` tokens, `shards` rows per micro-batch."""
    return batching.split_rows_of(batching.packed(seq, lens, budget), shards)


def _shared_prompts_in_budget(seq, lens, *, batch, budget, shards):
    """The same with each prompt's sequences as shared-prompt units."""
    prompt_lens, keys = _prompts(batch, seq)
    return batching.split_rows_of(batching.shared_prompt_packed(seq, lens, prompt_lens, keys, budget), shards)


def _one_per_row_in_budget(seq, lens, *, budget, view_len, shards):
    """One sequence per row of L = min(T, budget) tokens, shards · ⌊budget / L⌋ rows per micro-batch."""
    length = min(view_len, budget)
    rows = shards * max(budget // length, 1)
    return [batching.one_per_row(seq[j:j + rows], lens[j:j + rows], rows, length) for j in range(0, len(seq), rows)]


def _packed_one_call(seq, lens, *, row_tokens, shards):
    """One micro-batch: first-fit decreasing into rows of `row_tokens` (the whole batch's longest sequence)."""
    return [batching.packed(seq, lens, row_tokens, shards)]


def _shared_prompts_one_call(seq, lens, *, batch, shards, min_len):
    """One micro-batch of shared-prompt units, in rows of this mini-batch's longest prompt group."""
    prompt_lens, keys = _prompts(batch, seq)
    longest = int(batching.shared_prompt_group_tokens(lens, prompt_lens, keys).max())
    row_tokens = batching.packed_row_length(longest, min_len)
    return [batching.shared_prompt_packed(seq, lens, prompt_lens, keys, row_tokens, shards)]


def _view_rows(seq, lens, *, rows, view_len):
    """One micro-batch: the view's own `rows` rows of this mini-batch (`rows` = rows_per_minibatch)."""
    return [batching.one_per_row(seq, lens, rows, view_len, row=seq % rows)]


def _prompts(batch, seq):
    """Prompt lengths [n] of the sequences `seq`, and their prompt tokens as bytes (equal bytes: one group)."""
    prompt_lens = np.asarray(batch["prompt_len"])[seq]
    return prompt_lens, [batch["input_ids"][i, :p].tobytes() for i, p in zip(seq, prompt_lens)]


def _sequence_lengths(batch: dict, budget: int | None) -> np.ndarray:
    """[N] lengths of the one-sequence-per-row view's sequences; refuses any other batch, and a sequence
    over the token budget."""
    if "seq_len" not in batch:
        raise ValueError("the batch has no per-sequence index (seq_len, ...); build it with "
                         "dapo.build_batch or batching.pack_rollouts")
    lengths = np.asarray(batch["seq_len"])                                            # [N]
    one_per_row = (np.asarray(batch["seq_row"]) == np.arange(len(lengths))).all()
    if not one_per_row or (np.asarray(batch["seq_start"]) != 0).any():
        raise ValueError("Learner.prepare takes the one-sequence-per-row view (pack_rollouts(pack=False), "
                         "as dapo.build_batch makes it); the learner packs the micro-batches itself")
    if budget is not None and lengths.size and lengths.max() > budget:
        raise MicroBatchBudgetError(
            f"a sequence of {int(lengths.max())} tokens (prompt + response) does not fit "
            f"learner_jax.MemoryConfig.max_tokens_per_micro_batch={budget} (sequences are never split); raise it to at least "
            f"{int(lengths.max())}")
    return lengths


class Learner:
    def __init__(self, model, optimizer: nnx.Optimizer, cfg, correction: tis.RolloutCorrectionConfig, *,
                 mesh: jax.sharding.Mesh | None = None, memory: MemoryConfig | None = None, routing: str = "own",
                 compare_routing: bool | None = None):
        """`mesh`: shard model + optimizer over it (in place) and run every step sharded; None: as is.
        `memory`: layout of the micro-batches (`MemoryConfig`; attention_impl / remat belong to the model).
        `routing`, `compare_routing`: MoE policies, as `rl.PrecisionConfig`'s (module doc)."""
        self.model, self.optimizer, self.cfg, self.correction = model, optimizer, cfg, correction
        self.mesh, self.memory = mesh, memory or MemoryConfig()
        self.bypass = cfg.loss.policy_loss_mode == "bypass"  # cfg: a DapoConfig (rl/config.py's parts)
        if self.bypass and correction.enabled:
            raise ConfigError(
                f"policy_loss_mode='bypass' sets π_old := π_rollout, so the rollout correction (mode="
                f"{correction.mode!r}, or a mask) has nothing to correct and its weights would count the PPO ratio's "
                "IS twice; set tis.RolloutCorrectionConfig.mode = 'none' with no masks, or policy_loss_mode = "
                "'decoupled'")
        self.replays = routing == "replay"
        self.compare_routing = self.replays if compare_routing is None else compare_routing
        if (self.replays or self.compare_routing) and not model.config.is_moe:
            raise ConfigError(f"rl.PrecisionConfig.routing={routing!r} / compare_routing={compare_routing} need a "
                              f"mixture-of-experts policy; {model.config.family} is dense: set routing = 'own' and "
                              "compare_routing = None")
        self.updates = 0  # optimizer-update passes run (`update` calls): the version of the policy
        self.shards = batch_shards(mesh) if mesh is not None else 1
        if mesh is None:
            # Commit every buffer to the device it is on: a jit output is committed, so otherwise the first
            # step (which writes the model back) changes the arguments' placement and the next one recompiles.
            for module in (model, optimizer):
                nnx.update(module, jax.tree.map(lambda x: jax.device_put(x, x.sharding), nnx.state(module)))
        else:
            shard_model_and_optimizer(model, optimizer, mesh)
            unpacked_one_call = not self.memory.pack_sequences and self.memory.max_tokens_per_micro_batch is None
            if unpacked_one_call and cfg.rows_per_minibatch % self.shards:
                raise ConfigError(f"rows_per_minibatch={cfg.rows_per_minibatch} (mini_batch_size × n_samples) is not "
                                  f"a multiple of the mesh's {self.shards} batch shards (data × fsdp)")
        self.served = MASTER  # the weights its forwards use (`serve_weights_as`)
        self._use_jitted()
        self._correct = _correction_fn(correction)
        # the first mini-batch's old logprobs from its own update: when, and why (DeferredMiniBatch)
        self.defers_first_mini_batch = (not self.bypass and cfg.loss.old_logprobs_from_update
                                        and correction.token_local and (self.replays or not self.compare_routing))

    def _use_jitted(self):
        loss = self.cfg.loss
        fns = _jitted(_LossSettings(loss.clip_eps_low, loss.clip_eps_high, loss.dual_clip_c, loss.policy_loss_mode,
                                    loss.router_aux_loss_coef),
                      self.cfg.generation.temperature, self.memory.logprob_chunk_tokens, self.correction, self.served,
                      self.memory.update_by_layer)
        self._logprobs, self._row_logprobs = fns["logprobs"], fns["row_logprobs"]
        self._own_routing_scores = fns["own_routing_scores"]
        self._train_step, self._grad_step, self._apply_step = fns["train_step"], fns["grad_step"], fns["apply_step"]

    @property
    def serves_engine_weights(self) -> bool:
        return self.served != MASTER

    def serve_weights_as(self, quantization: str | None, smoothing=None) -> None:
        """From now on, old logprobs, the PPO ratio and the loss (and `logprobs`) use the weights an engine
        reporting `quantization` serves: its weight quantizer on the master projections inside the forward,
        straight-through gradients to the masters (rl/served_view.py; `rl.PrecisionConfig.learner_precision =
        'engine'`). train() calls it once the engine's quantization is known. `smoothing`: refused (not emulated)."""
        if quantization not in SERVED_WEIGHTS:
            supported = ", ".join(map(repr, SERVED_WEIGHTS))
            raise ConfigError(f"learner_precision='engine': the engine's quantization {quantization!r} has no JAX "
                              f"quantizer (supported: {supported}); use rl.PrecisionConfig.learner_precision = 'master'")
        if smoothing is not None:
            raise ConfigError("learner_precision='engine' does not emulate SmoothQuant's rescaling; set "
                              "rl.PrecisionConfig.smoothquant_alpha = None or learner_precision = 'master'")
        self.served = quantization
        self._use_jitted()

    # ------------------------------------------------------------------------------ layout
    def micro_layouts(self, batch: dict) -> list[list[batching.Layout]]:
        """Per mini-batch, the `batching.Layout`s of its micro-batches (all of one shape; module doc)."""
        mem, budget, shards = self.memory, self.memory.max_tokens_per_micro_batch, self.shards
        rpm, min_len = self.cfg.rows_per_minibatch, self.cfg.shapes.min_seq_bucket
        lengths = _sequence_lengths(batch, budget)                                    # [N]
        view_rows, view_len = batch["input_ids"].shape
        if budget is not None and mem.share_prompts:
            layout = functools.partial(_shared_prompts_in_budget, batch=batch, budget=budget, shards=shards)
        elif budget is not None and mem.pack_sequences:
            layout = functools.partial(_packed_in_budget, budget=budget, shards=shards)
        elif budget is not None:
            layout = functools.partial(_one_per_row_in_budget, budget=budget, view_len=view_len, shards=shards)
        elif mem.share_prompts:
            layout = functools.partial(_shared_prompts_one_call, batch=batch, shards=shards, min_len=min_len)
        elif mem.pack_sequences:
            row_tokens = batching.packed_row_length(int(lengths.max(initial=1)), min_len)
            layout = functools.partial(_packed_one_call, row_tokens=row_tokens, shards=shards)
        else:
            layout = functools.partial(_view_rows, rows=rpm, view_len=view_len)
        out = []
        for first in range(0, view_rows, rpm):
            seq = np.arange(first, min(first + rpm, len(lengths)))                   # view rows of this mini-batch
            seq = seq[lengths[seq] > 0]
            out.append(layout(seq, lengths[seq]) if seq.size else [])
        return out

    def _device(self, arrays: dict) -> dict:
        return shard_batch(arrays, self.mesh) if self.mesh is not None else arrays

    def _on_mesh(self):
        """Context for the jitted calls: the mesh set (`jax.set_mesh`), so the model's
        `sharding.constrain_batch_rows` keeps activations split by rows; nothing without a mesh."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------ logprobs
    def logprobs(self, input_ids, attention_mask) -> np.ndarray:
        """[B, T] logprobs of the current policy at the rollout temperature (entry t: token t given < t),
        one sequence per row (the post-sync probe)."""
        if self.mesh is None:
            return np.asarray(self._logprobs(self.model, input_ids, attention_mask))
        rows = len(input_ids)  # any B (e.g. the probe): pad with empty rows to a multiple of the shards
        ways = self.shards
        batch = shard_batch({"input_ids": pad_rows(np.asarray(input_ids), ways),
                             "attention_mask": pad_rows(np.asarray(attention_mask), ways)}, self.mesh)
        with self._on_mesh():
            logp = self._logprobs(self.model, batch["input_ids"], batch["attention_mask"])
        return to_host(logp)[:rows]

    def scoring_view(self, wrap) -> "Learner":
        """A view of this learner (same model, mesh and layout; nothing copied) whose `logprobs` runs
        `wrap(forward)` instead of its jitted forward `forward(model, input_ids, attention_mask)`: how the
        mismatch split (rl/mismatch_split.py) scores the probe with, e.g., quantized projections."""
        view = copy.copy(self)
        view._logprobs = wrap(self._logprobs)
        return view

    def old_logprobs(self, batch: dict, layouts=None, skip: int | None = None) -> np.ndarray:
        """[N, T] logprobs of the current (pre-update) policy in the per-sequence view, computed on the
        update's micro-batches (0 off the response mask, and on mini-batch `skip`'s sequences); with routing
        replay, under the engine's routing."""
        return self._score(batch, layouts, skip, replay=self.replays)[0]

    def _score(self, batch: dict, layouts=None, skip: int | None = None, *, replay: bool, agreement=False):
        """(logprobs [N, T] as `old_logprobs`, under the engine's routing (`replay`) or the learner's own; with
        `agreement`, also (agreeing (token, layer) pairs, pairs) of the own routing with the engine's)."""
        layouts = self.micro_layouts(batch) if layouts is None else layouts
        if replay or agreement:
            _require_routing(batch)
        view = _view(batch)
        keys = _FORWARD_KEYS + ((_ROUTED,) if replay else ())
        old, agree = np.zeros(batch["input_ids"].shape, np.float32), np.zeros(2, np.int64)
        for layout in (lay for i, mini in enumerate(layouts) if i != skip for lay in mini):
            rows = layout.arrays(view)
            inputs = self._device({k: rows[k] for k in keys if k in rows})
            with self._on_mesh():
                if agreement:
                    logp, *pairs = self._own_routing_scores(self.model, inputs, self._device(
                        {_ROUTED: rows[_ROUTED]})[_ROUTED])
                    agree += np.asarray(jax.device_get(pairs), np.int64)
                else:
                    logp = self._row_logprobs(self.model, inputs)
            layout.to_view(to_host(logp), old)
        return old * batch["response_mask"], (agree if agreement else None)

    # ------------------------------------------------------------------------------ prepare
    def prepare(self, batch: dict) -> PreparedBatch:
        """Old logprobs, the rollout correction and the loss weights for `batch` (a `dapo.build_batch` /
        `batching.pack_rollouts` per-sequence view, not modified) → the `PreparedBatch` `update` takes.

        Decoupled: old logprobs from one forward pass per micro-batch of the current policy, then the
        correction; with `defers_first_mini_batch`, not for the first non-empty mini-batch (its update
        computes them, and the `tis/*` metrics come from `update`). Bypass: old := rollout logprobs,
        weights 1, nothing rejected, no forward pass."""
        if self.replays or self.compare_routing:  # the loss replays too, so also in bypass (no forward here)
            _require_routing(batch)
        layouts = self.micro_layouts(batch)
        mask = np.asarray(batch["response_mask"], np.float32)
        deferred = DeferredMiniBatch.first(batch, layouts) if self.defers_first_mini_batch else None
        if self.bypass:
            old = np.asarray(batch["rollout_logprobs"], np.float32) * mask
            weights, keep, metrics, agreement = mask.copy(), np.ones_like(mask), {}, None
        else:
            old, agreement = self._score(batch, layouts, skip=None if deferred is None else deferred.index,
                                         replay=self.replays, agreement=self.compare_routing and not self.replays)
            weights, keep, metrics = self._correct(old, batch["rollout_logprobs"], batch["response_mask"])
            weights, keep = np.array(weights), np.asarray(keep)
            if deferred is not None:  # of a view whose deferred rows are 0: its `complete` reports them
                metrics = {}
        routing_metrics = self._compare_routing(batch, layouts, agreement)
        loss_mask = batch["response_mask"] * keep                                        # [N, T]
        view = _view(batch)
        if not self.replays:  # the engine's routing (compare_routing) stays out of the training forwards
            view.pop(_ROUTED, None)
        view.update(old_logprobs=old, tis_weights=weights, keep_mask=keep,
                    token_weights=np.zeros_like(loss_mask))
        micro, padding, tokens, rows, laid_out = [], 0, 0, 0, 0
        for index, mini in enumerate(layouts):
            if not mini:
                micro.append([])
                continue
            seq = _sequences(mini)                                                       # view rows of it
            view["token_weights"][seq] = loss_token_weights(
                loss_mask[seq], self.cfg.loss.loss_aggregation, self.cfg.norm_constant,
                num_sequences=len(seq))
            micro.append([lay.arrays(view) for lay in mini])
            padding += sum(lay.padding_tokens for lay in mini)
            laid_out += sum(int(lay.length.sum()) for lay in mini)
            tokens += sum(lay.rows * lay.row_tokens for lay in mini)
            rows += sum(lay.rows for lay in mini)
        out = {f"tis/{k}": float(v) for k, v in metrics.items()} | routing_metrics
        if metrics:  # per-turn mismatch of multi-turn trajectories: does it grow with the turn?
            out.update(turn_metrics(old, batch["rollout_logprobs"], batch["response_mask"], batch.get("turn_index")))
        # batch/learner_tokens: the real tokens of the micro-batches (fewer than the sequences' with share_prompts)
        out.update({"batch/padding_fraction": padding / max(tokens, 1), "batch/rows": rows,
                    "batch/learner_tokens": laid_out,
                    "batch/row_tokens": max((m[0].row_tokens for m in layouts if m), default=0),
                    "batch/micro_batches": sum(len(m) for m in layouts)})
        prepared = PreparedBatch(micro_batches=micro, old_logprobs=old, tis_weights=weights, keep_mask=keep,
                                 metrics=out, policy_version=None if self.bypass else self.updates)
        return prepared if deferred is None else deferred.leave_out(prepared)

    def _compare_routing(self, batch: dict, layouts, agreement) -> dict:
        """`compare_routing`'s metrics (module doc): the step scored under the other routing, one forward pass
        (and, own routing in bypass, a second for the agreement); `agreement`: the old-logprob pass's, if any."""
        if not self.compare_routing:
            return {}
        other, other_agreement = self._score(batch, layouts, replay=not self.replays, agreement=self.replays)
        if self.replays:
            agreement = other_agreement
        elif agreement is None:
            agreement = self._score(batch, layouts, replay=False, agreement=True)[1]
        _, _, metrics = self._correct(other, batch["rollout_logprobs"], batch["response_mask"])
        name = "tis/kl_own_routing" if self.replays else "tis/kl_replayed_routing"
        return {"moe/routing_agreement": float(agreement[0] / max(agreement[1], 1)), name: float(metrics["kl"])}

    # ------------------------------------------------------------------------------ update
    def _check_fresh(self, prepared: PreparedBatch, what: str) -> None:
        if not isinstance(prepared, PreparedBatch):
            raise TypeError(f"Learner.{what} takes the PreparedBatch returned by Learner.prepare(batch)")
        if prepared.policy_version is not None and prepared.policy_version != self.updates:
            raise ValueError(f"this PreparedBatch's old logprobs are of the policy before update "
                             f"{prepared.policy_version + 1}, and {self.updates - prepared.policy_version} "
                             "update(s) ran since; prepare it again right before updating")

    def _micro_batch_gradients(self, micro: list[dict]) -> tuple:
        """(Σ over the micro-batches of ∇loss, in a f32 accumulator; each micro-batch's metrics)."""
        grads = zero_grads(self.model)
        parts = [self._grad_step(self.model, self._device(mb), grads) for mb in micro]  # grads += ∇ in place
        return grads, parts

    def update(self, prepared: PreparedBatch) -> dict:
        """ppo_epochs passes of one optimizer update per mini-batch; returns `train/*` averaged over updates,
        and with a deferred mini-batch the `tis/*` metrics (module doc). `prepared` is not modified."""
        self._check_fresh(prepared, "update")
        self.updates += 1
        history, tis_metrics = [], {}
        for _ in range(self.cfg.loss.ppo_epochs):
            for index, micro in enumerate(prepared.micro_batches):
                if not any(mb["response_mask"].any() for mb in micro):  # empty (short dynamic-sampling step)
                    continue
                with self._on_mesh():
                    if len(micro) == 1 and not self.memory.update_by_layer:  # the update in the same call
                        parts = [self._train_step(self.model, self.optimizer, self._device(micro[0]))]
                        applied = parts[0]
                    else:
                        grads, parts = self._micro_batch_gradients(micro)
                        applied = self._apply_step(self.model, self.optimizer, grads)
                if prepared.deferred is not None and index == prepared.deferred.index:
                    # this forward gave the old logprobs: later passes (ppo_epochs > 1) train on the completed batch
                    prepared = prepared.deferred.complete(prepared, parts, self.correction)
                    tis_metrics = {k: v for k, v in prepared.metrics.items() if k.startswith("tis/")}
                parts = jax.device_get(parts)
                update = combine_metrics([{k: float(v) for k, v in p.items()} for p in parts])
                update.update({k: float(v) for k, v in jax.device_get(applied).items()
                               if k in ("grad_norm", "learning_rate")})
                history.append(update)
        if not history:
            return tis_metrics
        return {**tis_metrics, **{f"train/{k}": float(np.mean([h[k] for h in history])) for k in history[0]}}

    def gradient(self, prepared: PreparedBatch) -> tuple[np.ndarray, dict]:
        """The policy-loss gradient at the current weights, with no optimizer update: per non-empty mini-batch
        the sum over its micro-batches of ∇loss (what `update`'s first pass hands the optimizer, the deferred
        mini-batch's own forward included), then the mean over mini-batches, flattened in `jax.tree.leaves`
        order of the model's `nnx.Param`s → (float32 [num_params], the deferred mini-batch's `tis/*` and the
        `train/*` loss metrics). The weights, the optimizer and `updates` are unchanged, so the same
        PreparedBatch may still go to `update`."""
        self._check_fresh(prepared, "gradient")
        total, minis, parts_all, tis_metrics = None, 0, [], {}
        for index, micro in enumerate(prepared.micro_batches):
            if not any(mb["response_mask"].any() for mb in micro):
                continue
            with self._on_mesh():
                grads, parts = self._micro_batch_gradients(micro)
            if prepared.deferred is not None and index == prepared.deferred.index:
                completed = prepared.deferred.complete(prepared, parts, self.correction)
                tis_metrics = {k: v for k, v in completed.metrics.items() if k.startswith("tis/")}
            flat = np.concatenate([np.asarray(jax.device_get(g), np.float32).ravel() for g in jax.tree.leaves(grads)])
            total = flat if total is None else total + flat
            minis += 1
            parts_all += [{k: float(v) for k, v in p.items()} for p in jax.device_get(parts)]
        if total is None:
            size = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(self.model, nnx.Param)))
            return np.zeros(size, np.float32), tis_metrics
        total /= minis
        metrics = {f"train/{k}": v for k, v in combine_metrics(parts_all).items()}
        return total, {**tis_metrics, **metrics, "train/grad_norm": float(np.linalg.norm(total))}
