"""The loop's settings, one small frozen config per concern. `train()` takes them as objects; gin binds their
fields (`rl.GenerationConfig.n_samples = 8`); `dapo.DapoConfig` holds the five that define the algorithm.

    RunConfig          the run: where it writes, how long, evaluation, checkpoints, async rollouts
    PrecisionConfig    the learner's dtypes and the push's SmoothQuant
    DiagnosticsConfig  what is measured after each push (rl/diagnostics.py)
    GenerationConfig   what the engine samples per prompt
    DataConfig         how prompts become a step's groups
    ShapeConfig        the padded shapes the learner compiles for
    LossConfig         advantages → PPO loss → optimizer updates
    SafetyConfig       when a broken engine stops the run
    EnvironmentConfig  what a trajectory talks to between turns, and when it ends

Each validates its own fields (a one-line `ConfigError`); rules that tie two concerns together (e.g.
prompt_batch_size a multiple of mini_batch_size) are `DapoConfig`'s. Every field has one line in its class's
`Attributes:` section: docs/reference/configuration.md is generated from them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from portable_rl.errors import ConfigError

ADVANTAGES = ("grpo", "drgrpo")
DTYPES = ("float32", "bfloat16", "float16")
DIAGNOSTICS = ("update_survival", "probe", "mismatch_split")  # rl/diagnostics.py, in the order the step runs them
LEARNER_PRECISIONS = ("master", "engine")
ROUTINGS = ("own", "replay")  # PrecisionConfig.routing


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run: where it writes, how long it trains, when it evaluates and checkpoints.

    Attributes:
      run_dir: where the run writes config.gin, metrics.jsonl, tensorboard/, *.png and checkpoints/; rerunning
        the same command resumes from its newest checkpoint.
      train_steps: number of RL steps (the last one is evaluated and checkpointed).
      model_path: the starting HF checkpoint directory (created by `warmstart_fn` when missing).
      seed: rollout sampling seeds (with the step and draw); the task's data order has its own seed.
      chat_template: wrap prompts in the tokenizer's chat template.
      async_rollouts: generate step k+1 while the learner trains on step k (one step off-policy).
      eval_every: greedy held-out accuracy every this many steps (and at the last one); 0: only at step 0.
      eval_max_tokens: response budget of the held-out evaluation; None: the rollouts' max_response_tokens.
      eval_size: held-out examples evaluated; None: all the task offers.
      checkpoint_every: save the learner (params, optimizer) every this many steps.
      keep_checkpoints: newest checkpoints kept on disk.
    """
    run_dir: str
    train_steps: int
    model_path: str
    seed: int = 0
    chat_template: bool = False
    async_rollouts: bool = False
    eval_every: int = 10
    eval_max_tokens: Optional[int] = None
    eval_size: Optional[int] = None
    checkpoint_every: int = 10
    keep_checkpoints: int = 2

    def __post_init__(self):
        if self.train_steps < 1:
            raise ConfigError(f"train_steps={self.train_steps} must be >= 1 (rl.RunConfig.train_steps)")
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every}, keep_checkpoints={self.keep_checkpoints} "
                              "must be >= 1")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every={self.eval_every} must be >= 0 (0: evaluate at step 0 only)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """The learner's dtypes, what the weight push does for an INT8 W8A8 engine, and whose weights the learner's
    forwards use (its own, or the engine's served ones).

    Attributes:
      param_dtype: dtype of the model's parameters (and of the weights pushed before the bf16 cast).
      master_dtype: the optimizer's master copy when it differs from param_dtype (bf16 params + f32 master
        weights); None: no master copy.
      compute_dtype: dtype of the learner's matmuls and activations.
      smoothquant_alpha: with an INT8 W8A8 engine, SmoothQuant factors calibrated once on the first training
        prompts and applied to every push (0.5 is SmoothQuant's default); None: off.
      learner_precision: 'master': the learner's forwards (old logprobs, PPO ratio, loss) use its own weights;
        'engine': the weights the engine serves (its weight quantizer on the projections, straight-through
        gradients to the masters; rl/served_view.py), for fp8_per_channel, int8_per_channel, unquantized and
        fake-quant (fake_mxfp4, fake_nvfp4, fake_fp8_e4m3_tensor) engines; weights only (not W8A8's activations).
      routing: mixture-of-experts policies. 'own': the learner's forwards route every token with their own
        router's top-k. 'replay': the engine returns the experts it routed each position to and the learner's
        forwards (old logprobs, PPO ratio, loss) use them, gate weights recomputed from the learner's router
        (docs/training.md "Routing replay"); needs an engine started with return_routed_experts=True.
      compare_routing: also score each step's rollouts under the other routing (one extra forward-only pass)
        and report moe/routing_agreement and tis/kl_own_routing (replay) or tis/kl_replayed_routing (own; the
        engine is then asked for its routing too). None: True with routing='replay', False with 'own'.
    """
    param_dtype: str = "float32"
    master_dtype: Optional[str] = "float32"
    compute_dtype: str = "bfloat16"
    smoothquant_alpha: Optional[float] = None
    learner_precision: str = "master"
    routing: str = "own"
    compare_routing: Optional[bool] = None

    @property
    def engine_routing(self) -> bool:
        """True when the engine must return its routed experts (replay, or a comparison with it)."""
        return self.routing == "replay" or bool(self.compare_routing)

    def __post_init__(self):
        for name in ("param_dtype", "master_dtype", "compute_dtype"):
            value = getattr(self, name)
            if value not in DTYPES and not (name == "master_dtype" and value is None):
                raise ConfigError(f"{name}={value!r}; use one of {DTYPES}")
        if self.smoothquant_alpha is not None and not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ConfigError(f"smoothquant_alpha={self.smoothquant_alpha} must be in [0, 1] (or None: off)")
        if self.learner_precision not in LEARNER_PRECISIONS:
            raise ConfigError(f"learner_precision={self.learner_precision!r}; use one of {LEARNER_PRECISIONS}")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing={self.routing!r}; use one of {ROUTINGS}")
        if self.learner_precision == "engine" and self.smoothquant_alpha is not None:
            raise ConfigError(f"learner_precision='engine' does not emulate SmoothQuant (smoothquant_alpha="
                              f"{self.smoothquant_alpha}); set rl.PrecisionConfig.smoothquant_alpha = None")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """What the engine samples per prompt. Truncated sampling (top_p / top_k): the engine returns each token's
    sampling support and the learner renormalises over it, so rollout and learner logprobs stay the same
    quantity (docs/tis.md).

    Attributes:
      n_samples: responses sampled per prompt (a group; its advantages are relative to each other).
      temperature: sampling temperature; the learner scores at the same temperature.
      max_response_tokens: the longest response the engine may generate.
      top_p: nucleus sampling threshold; 1.0: off. Below 1 it needs top_k >= 1 too.
      top_k: sample from the k likeliest tokens; -1: off.
    """
    n_samples: int = 16
    temperature: float = 1.0
    max_response_tokens: int = 64
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self):
        if self.n_samples < 2:
            raise ConfigError(f"n_samples={self.n_samples}: group advantages need at least 2 samples per prompt")
        if self.max_response_tokens < 1:
            raise ConfigError(f"max_response_tokens={self.max_response_tokens} must be >= 1")
        if self.top_p != 1.0 and self.top_k == -1:  # the top_k-bound message, before SamplingConfig's
            raise ConfigError(f"top_p={self.top_p} needs top_k >= 1 too (e.g. rl.GenerationConfig.top_k = 64): the engine "
                              "returns each token's sampling support, and top_k bounds its size")
        try:
            self.sampling()
        except ValueError as e:
            raise ConfigError(f"rl.GenerationConfig: {e}") from None

    @property
    def truncated(self) -> bool:
        """True for top-k / top-p sampling: rollouts carry their sampling support."""
        return self.top_p != 1.0 or self.top_k != -1

    def sampling(self, *, seed=None, stop_token_ids=(), return_routed_experts=False):
        """The engines.base.SamplingConfig of a training rollout (truncated: with the support returned;
        `return_routed_experts`: with the engine's routing, `PrecisionConfig.engine_routing`)."""
        from portable_rl.engines.base import SamplingConfig

        return SamplingConfig(temperature=self.temperature, max_tokens=self.max_response_tokens, n=self.n_samples,
                              seed=seed, stop_token_ids=stop_token_ids, top_p=self.top_p, top_k=self.top_k,
                              return_support=self.truncated, return_routed_experts=return_routed_experts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """How prompts become a step's groups (DAPO's dynamic sampling).

    Attributes:
      prompt_batch_size: prompt groups per training step (after dynamic sampling).
      dynamic_sampling: drop groups whose rewards are all equal, and draw again to refill the step.
      max_gen_batches: generation batches drawn per step at most (a step may train on fewer groups).
    """
    prompt_batch_size: int = 32
    dynamic_sampling: bool = True
    max_gen_batches: int = 3

    def __post_init__(self):
        if self.max_gen_batches < 1:
            raise ConfigError(f"max_gen_batches={self.max_gen_batches} must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapeConfig:
    """The padded shapes the learner compiles for.

    Attributes:
      min_seq_bucket: shortest padded row; rows are powers of two >= it (multiples of 64 past 64).
    """
    min_seq_bucket: int = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Advantages → PPO loss → optimizer updates (docs/losses.md).

    Attributes:
      overlong_buffer: L_buf of DAPO's overlong shaping: responses within L_buf of the limit are penalised
        linearly; 0: off.
      overlong_penalty: the shaping's largest penalty (at the limit).
      advantage: 'grpo' ((r − mean) / std within the group) or 'drgrpo' (r − mean).
      mini_batch_size: prompt groups per optimizer update.
      ppo_epochs: passes over the step's batch.
      clip_eps_low: PPO ratio clip below 1 (1 − ε_low).
      clip_eps_high: PPO ratio clip above 1 (1 + ε_high; DAPO's clip-higher when > clip_eps_low).
      dual_clip_c: dual-clip bound for negative advantages (> 1); None: off.
      loss_aggregation: how token losses become one number: 'token-mean', 'seq-mean-token-mean',
        'seq-mean-token-sum', 'seq-mean-token-sum-norm', 'token-sum-norm'.
      loss_norm_constant: L of 'seq-mean-token-sum-norm'; None: max_response_tokens.
      policy_loss_mode: 'decoupled' (old logprobs recomputed by the learner, rollout correction applied) or
        'bypass' (old := rollout logprobs: no recompute, no correction weights).
      old_logprobs_from_update: decoupled: the first mini-batch's old logprobs come from its own update's
        forward (the policy has not moved yet), one forward fewer per step; only with a token-local correction.
      router_aux_loss_coef: MoE policies: coefficient of transformers' load-balancing loss
        (learner_jax/moe.py), added to every loss token's term under the loss aggregation; 0: off, as in RL
        recipes (transformers' pre-training default is 0.001).
    """
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    advantage: str = "grpo"
    mini_batch_size: int = 32
    ppo_epochs: int = 1
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    dual_clip_c: Optional[float] = None
    loss_aggregation: str = "token-mean"
    loss_norm_constant: Optional[int] = None
    policy_loss_mode: str = "decoupled"
    old_logprobs_from_update: bool = True
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        # the loss owns the lists; checked here, at config time, and nowhere else
        from portable_rl.learner_jax.losses import AGGREGATIONS, POLICY_LOSS_MODES

        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"advantage={self.advantage!r}; use one of {ADVANTAGES}")
        if self.policy_loss_mode not in POLICY_LOSS_MODES:
            raise ConfigError(f"policy_loss_mode={self.policy_loss_mode!r}; use one of {POLICY_LOSS_MODES}")
        if self.loss_aggregation not in AGGREGATIONS:
            raise ConfigError(f"loss_aggregation={self.loss_aggregation!r}; use one of {AGGREGATIONS}")
        if self.router_aux_loss_coef < 0:
            raise ConfigError(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (0: off)")
        for name in ("mini_batch_size", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.overlong_buffer < 0:
            raise ConfigError(f"overlong_buffer={self.overlong_buffer} must be >= 0 (0 disables overlong shaping)")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ConfigError(f"clip_eps_low={self.clip_eps_low}, clip_eps_high={self.clip_eps_high} must be >= 0")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ConfigError(f"dual_clip_c={self.dual_clip_c} must be > 1 (or None to disable dual clip)")
        if self.loss_norm_constant is not None and self.loss_norm_constant < 1:
            raise ConfigError(f"loss_norm_constant={self.loss_norm_constant} must be >= 1 (or None: max_response_tokens)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SafetyConfig:
    """When a broken engine stops the run.

    Attributes:
      max_nonfinite_fraction: NaN/inf rollout logprobs are masked out of the loss; above this fraction of a
        step's tokens the run stops.
    """
    max_nonfinite_fraction: float = 0.01

    def __post_init__(self):
        if not 0.0 <= self.max_nonfinite_fraction <= 1.0:
            raise ConfigError(f"max_nonfinite_fraction={self.max_nonfinite_fraction} must be in [0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvironmentConfig:
    """What a trajectory talks to between the model's turns, and when it ends (rl/turns.py, docs/environments.md).

    Attributes:
      name: a registered environment (`environments.register_environment`); 'single_turn': the task's prompt,
        one turn, scored by the task's reward.
      kwargs: keyword arguments of the environment's constructor, one instance per trajectory; an environment
        whose constructor takes `reward` gets the task's reward function unless this sets it.
      max_turns: model turns per trajectory at most (the last one ends it with finish reason 'max_turns').
      max_total_tokens: a trajectory's tokens at most, prompt, turns and observations together (SkyRL's
        max_input_length); a turn or observation that would pass it ends the trajectory ('token_budget').
        None: no budget beyond max_turns × max_response_tokens.
      step_timeout_s: seconds one environment step may take; a slower (or raising) step ends its trajectory with
        reward 0 ('env_timeout' / 'env_error') and training goes on.
      workers: threads that run environment steps concurrently.
      observation_role: the chat role observations are formatted as ('user', or 'tool' where the template has it).
    """
    name: str = "single_turn"
    kwargs: dict = dataclasses.field(default_factory=dict, hash=False)
    max_turns: int = 1
    max_total_tokens: Optional[int] = None
    step_timeout_s: float = 60.0
    workers: int = 16
    observation_role: str = "user"

    def __post_init__(self):
        object.__setattr__(self, "kwargs", dict(self.kwargs))  # gin may give any mapping
        if self.max_turns < 1:
            raise ConfigError(f"max_turns={self.max_turns} must be >= 1 (rl.EnvironmentConfig.max_turns)")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ConfigError(f"max_total_tokens={self.max_total_tokens} must be >= 2 (or None: no budget)")
        if not self.step_timeout_s > 0 or self.workers < 1:
            raise ConfigError(f"step_timeout_s={self.step_timeout_s} must be > 0 and workers={self.workers} >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagnosticsConfig:
    """The diagnostics run after every push (rl/diagnostics.py), each on unless named in `disabled`.

    Attributes:
      disabled: names of diagnostics not to run: any of 'update_survival', 'probe', 'mismatch_split'
        (disabling the probe disables the split too).
      probe_prompts: held-out prompts the probe samples after every push.
      update_survival_stride: every k-th output channel of each projection is tracked by update_survival.
    """
    disabled: tuple[str, ...] = ()
    probe_prompts: int = 4
    update_survival_stride: int = 16

    def __post_init__(self):
        object.__setattr__(self, "disabled", tuple(self.disabled))  # gin gives lists
        unknown = [n for n in self.disabled if n not in DIAGNOSTICS]
        if unknown:
            raise ConfigError(f"rl.DiagnosticsConfig.disabled names {unknown}; the diagnostics are {list(DIAGNOSTICS)}")
        if self.probe_prompts < 1:
            raise ConfigError(f"probe_prompts={self.probe_prompts} must be >= 1 (to run no probe: "
                              "rl.DiagnosticsConfig.disabled = ['probe'])")
        if self.update_survival_stride < 1:
            raise ConfigError(f"update_survival_stride={self.update_survival_stride} must be >= 1 (to track "
                              "nothing: rl.DiagnosticsConfig.disabled = ['update_survival'])")

    def enabled(self, name: str) -> bool:
        return name not in self.disabled and not (name == "mismatch_split" and "probe" in self.disabled)
