"""The learner's memory strategy, chosen in one place (set from gin through `train`'s arguments).

Activation memory of one update, per device, for a micro-batch of M tokens, L layers, hidden D, vocab V:

    attention   blockwise / cudnn / splash: O(M · D) per layer     dense: O(B · N · T²) per layer
    layers      remat='none': every layer's activations kept        'full': one layer's + L residuals
    head        logprob_chunk_tokens=C: one [C, V] f32 chunk        None: the whole [M, V] f32 logits
    batch       max_tokens_per_micro_batch=M: gradients accumulated over micro-batches of <= M tokens
                per batch shard (a sequence is never split), one optimizer update per mini-batch
    rows        pack_sequences=True: sequences packed first-fit decreasing into rows (segment ids),
                no power-of-two padding
    prompts     share_prompts=True (with pack_sequences): the n answers of a prompt share one copy of
                its tokens (continuation segments, learner_jax/attention.py): n·(p + r) tokens become
                p − 1 + n·(r + 1). Less time and memory wherever prompts are a good part of the tokens.
                Attention runs blockwise for these rows (cuDNN / splash have no such mask).
    experts     moe_dispatch='local' (MoE models on a mesh): each device sorts its own M·K (token, expert)
                pairs and all-gathers one layer's expert weights at a time over fsdp inside a shard_map;
                'gspmd' leaves both to GSPMD, whose partition of the sort gathers every device's pairs
                (its temporaries grow with the device count; learner_jax/moe.py)
    optimizer   update_by_layer=True: the optimizer update runs as one call per decoder layer (learner_jax/step.py
                `LayerwiseApplyStep`): one layer's f32 temporaries instead of ~1.25 parameter-sized f32 buffers;
                the gradient is then always accumulated in f32 (one params-sized buffer) before the update

so memory grows linearly in tokens once attention is not dense. Every setting computes the same
update (tests/test_memory_equivalence.py); they trade memory for time.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from portable_rl.errors import ConfigError

ATTENTION_IMPLS = ("auto", "blockwise", "dense", "cudnn", "splash")
# 'none' | 'full' | a jax.checkpoint_policies name that saves matmul outputs ("dots saveable")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "checkpoint_dots", "checkpoint_dots_with_no_batch_dims")
MOE_DISPATCHES = ("gspmd", "local")   # learner_jax/moe.py, `Experts`


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """The learner's memory strategy; every setting computes the same update (module doc: what each costs).

    Attributes:
      attention_impl: "blockwise", "dense", "cudnn" (CUDA GPU only) or "splash" (TPU only); "auto": cudnn on a
        CUDA GPU, splash on TPU, blockwise elsewhere.
      pack_sequences: pack sequences first-fit decreasing into rows (segment ids); False: one sequence per
        row, padded to a power of two.
      max_tokens_per_micro_batch: tokens per micro-batch and batch shard (a sequence is never split);
        gradients are accumulated over the micro-batches, one optimizer update per mini-batch; None: one
        micro-batch per mini-batch.
      logprob_chunk_tokens: the head computes logits for about this many tokens per batch shard at a time
        (recomputed in the backward); None: all tokens at once.
      remat: "none" (keep every layer's activations), "full" (keep each layer's input, re-run its forward in
        the backward) or a `jax.checkpoint_policies` name that saves matmul outputs ("dots_saveable",
        "dots_with_no_batch_dims_saveable", "checkpoint_dots", "checkpoint_dots_with_no_batch_dims").
      share_prompts: the answers of one prompt share one copy of its tokens in the packed rows (needs
        pack_sequences; attention then runs blockwise for those rows).
      moe_dispatch: mixture-of-experts layers on a mesh: "gspmd" (GSPMD partitions the sort by expert over
        every device's tokens and gathers the expert weights) or "local" (each device sorts its own tokens in a
        shard_map and all-gathers the expert weights over fsdp inside it; with an expert axis the tokens of an
        expert group are exchanged there too). Same numbers either way.
      update_by_layer: run the optimizer update (clip, AdamW, master weights) as one call per decoder layer, so
        its f32 temporaries are one layer's, not the whole model's; the same update to float rounding. The
        gradient is then accumulated in an f32 buffer even for one micro-batch. Needs
        `learner_jax.make_optimizer`'s optimizer.
    """
    attention_impl: str = "auto"
    pack_sequences: bool = True
    max_tokens_per_micro_batch: Optional[int] = None
    logprob_chunk_tokens: Optional[int] = None
    remat: str = "none"
    share_prompts: bool = False
    moe_dispatch: str = "gspmd"
    update_by_layer: bool = False

    def __post_init__(self):
        if self.share_prompts and not self.pack_sequences:
            raise ConfigError("share_prompts=True lays out packed rows; set pack_sequences=True too "
                              "(or share_prompts=False)")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"attention_impl={self.attention_impl!r}; use one of {ATTENTION_IMPLS}")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"remat={self.remat!r}; use one of {REMAT_POLICIES}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ConfigError(f"moe_dispatch={self.moe_dispatch!r}; use one of {MOE_DISPATCHES}")
        for name in ("max_tokens_per_micro_batch", "logprob_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r} must be a positive int, or None")

    def model_kwargs(self) -> dict:
        """The knobs the model is built with: `Transformer(config, ..., **m.model_kwargs())` (and the
        same keywords on `convert.load_hf_model`); 'auto' attention is resolved by the model."""
        return {"attention_impl": self.attention_impl, "remat": self.remat, "moe_dispatch": self.moe_dispatch}
