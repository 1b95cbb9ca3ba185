"""The engine-adapter interface: plain data in, plain data out.

An adapter wraps one rollout engine (vLLM, SGLang, or anything registered through
`portable_rl.engines.registry`). The learner talks to it with token ids and `(hf_name, torch.Tensor)`
pairs only, so engines never see JAX and the learner never sees an engine object.

The one definition of a rollout logprob (docs/architecture.md):

    response_logprobs[t] = log_softmax(logits_t / T)[response_token_ids[t]]      (float32, natural log)

i.e. the log-probability of the sampled token under the full-vocabulary tempered distribution it was
sampled from. Top-k / top-p truncation changes that distribution: the token is drawn from the tempered
softmax renormalised over a support S_t (the top-k tokens, then the top-p nucleus of those), and its
logprob is log p − log Σ_{s∈S_t} p_s. `SamplingConfig` takes truncated sampling in one of two ways:

    return_support=True             the engine also returns S_t per token (`Rollout.sampling_support`);
                                    the learner renormalises over the same S_t, so the identity holds
                                    again (learner_jax/logprobs.py). Needs top_k > 0 (bounds |S_t|) and
                                    an adapter with `returns_sampling_support = True` (vLLM).
    allow_truncated_sampling=True   no support: rollout logprobs are the truncated distribution's and no
                                    longer match the learner's full-vocabulary ones (the mismatch is
                                    about the mean of −log Σ_{s∈S_t} p_s); an explicit opt-in.

Seeds. Sample j of prompt i in a batch gets the seed

    seed_ij = seed + i·n + j                                    (`SamplingConfig.seed_for(i, j)`)

so a prompt's samples do not depend on what else is in the batch, and a shard of the batch starting at
prompt s is the same as the whole batch with seed + s·n (the Ray fleet relies on this). `generate(...,
seeds=[s_0, s_1, ...])` replaces the rule's per-prompt part: sample j of prompt i gets s_i + j (e.g. the
multi-turn driver's per-trajectory seeds when only some trajectories are still running).

Serving (`EngineAdapter.serve`): requests that arrive while others run, for rollouts whose next request
depends on the last one's response (multi-turn environments, rl/turns.py):

    serve(requests, respond)   generates each request; every finished one goes to respond(finished), which
                               returns the next requests; until no request is left

An adapter implements it as `serving(requests)`, a generator that yields each batch of finished requests,
`[(request, rollouts), ...]`, and is sent the requests that follow them (`serve` drives it with `respond`:
`drive(session, respond)`; closing it drops what is still running). The generator lets a caller hold a serving
session open between calls: the Ray fleet keeps one per engine actor and answers each from the driver.

A `Request` carries its own `SamplingConfig` (its n samples get the seeds seed + j, i.e. `seed_for(0, j)`),
so a request's rollouts do not depend on when it was sent. The default serves `in_waves`: all the requests
at hand in one `generate` call per distinct sampling (seeds and max_tokens aside: the call takes the most
max_tokens and cuts each request's rollouts back to its own, finish_reason "length"; a seeded sample is the
same prefix at any max_tokens), then `respond` with all of them. An engine with continuous batching (vLLM)
overrides it: a finished request goes to `respond` after the engine step that finished it, and the next
requests join the running batch, so no request waits for the slowest of a wave. The Ray fleet serves each
trajectory on one engine (its follow-ups go where it started, onto its cached prefix) and answers each
engine's finished requests as they come, whichever engine finishes first.

Routed experts (mixture-of-experts policies; `SamplingConfig.return_routed_experts`, for routing replay).
An adapter with `returns_routed_experts = True` fills `Rollout.routed_experts` with the experts the engine's
router chose, as vLLM's `CompletionOutput.routed_experts` is: a numpy array [seq_len - 1, layers, top_k] of
expert ids, uint8 for up to 256 experts, else uint16 (an array, not lists: Qwen3-30B-A3B has 48 layers × 8
ids per position),

    routed_experts[p][l] = the top_k expert ids layer l routed the token at position p to, when that token
                           was the model's INPUT; p over the whole sequence prompt + response except its
                           last token (never an input), i.e. len(prompt) + len(response) - 1 rows

so row p is the routing behind the logits that score token p + 1: the learner re-scoring prompt + response
replays row p at position p. The order of the top_k ids within a row carries no meaning (vLLM-CPU's capture
sorts them). vLLM fills it through its own `enable_return_routed_experts` on GPU, and by capturing the
router's top-k inside the engine on vLLM-CPU, which refuses that option (engines/vllm_moe.py).

Stop strings. `SamplingConfig.stop` ends a response at the first token whose decoded text completes one of the
strings; that token is the response's last, and finish_reason is "stop":

    response_token_ids = the sampled ids up to and including the token that completes the stop string

so the ids the learner scores are the engine's, and the decoded text contains the string (it ends with it unless
that last token carries characters after it, e.g. ">\n"). vLLM: SamplingParams(stop=...,
include_stop_str_in_output=True); SGLang: sampling_params stop (its returned ids are never trimmed). Multi-turn
environments declare theirs (`environments.Environment.stop_strings`; the driver adds them).

Length. An adapter that knows its context sets `max_model_len`, the longest prompt + response it serves; a
response then stops at min(max_tokens, max_model_len − len(prompt)) tokens (finish_reason "length"), and a
prompt of max_model_len tokens or more is an error. The multi-turn driver keeps every later turn's prompt below
it (rl/turns.py).

Quantization. Every adapter reports `quantization`: None when it serves the pushed weights in their own
dtype (bf16), else the name of the scheme it serves (e.g. "fp8_per_channel", "fp8_blockwise",
"fake_mxfp4"). The post-sync probe judges a quantized engine by its report, not by the bf16 bound.

Push. `update_weights` takes one flat iterable of `(hf_name, torch.Tensor)` pairs, read once, and each
adapter buckets it for its own transport; the learner side (`rl.sync.push_weights`) never buckets:

    learner: iter_hf_tensors(model) ─► (name, tensor), (name, tensor), ...  ─► engine.update_weights
    vLLM:   list of refs → one layerwise reload      SGLang: bucketed_groups → k tensor-update calls
    Ray:    bucketed → ray.put once per bucket → every actor's adapter gets the flat pairs again
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Callable, Generator, Iterable, Iterator, Sequence, Tuple

from portable_rl.errors import ConfigError

FINISH_REASONS = ("stop", "length")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample. `temperature=0` is greedy (logprobs are then those of the untempered softmax)."""

    temperature: float = 1.0
    max_tokens: int = 64
    n: int = 1  # samples per prompt
    seed: int | None = None  # same seed + same weights → same samples
    stop_token_ids: Tuple[int, ...] = ()
    # Stop strings (module doc, "Stop strings"): a turn ends at the first token whose text completes one; that
    # token stays in the response (vLLM's include_stop_str_in_output=True), so the text ends with the string.
    stop: Tuple[str, ...] = ()
    top_p: float = 1.0
    top_k: int = -1
    # Truncated sampling with the support returned per token (module doc): exact logprobs for the learner.
    return_support: bool = False
    # Opt-in escape hatch: top-p / top-k without the support make rollout logprobs differ from the learner's.
    allow_truncated_sampling: bool = False
    # MoE: the experts the engine routed every position to (module doc, "Routed experts"), for routing replay.
    return_routed_experts: bool = False
    # No EOS or stop token ends a sample before it has this many tokens (the engine masks them until then);
    # min_tokens = max_tokens decodes exactly max_tokens per sample (benchmarks). 0: off, as rollouts need.
    min_tokens: int = 0

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop, str):
            raise ValueError(f"stop={self.stop!r} must be a tuple of strings, e.g. stop=({self.stop!r},)")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must hold non-empty strings")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if self.return_support and self.top_k < 1:
            raise ValueError(f"return_support=True with top_k={self.top_k}: set top_k >= 1 (e.g. 64) to bound "
                             "the support returned per token (top_p alone can keep most of the vocabulary)")
        if self.truncated and not (self.return_support or self.allow_truncated_sampling):
            raise ValueError(
                f"top_p={self.top_p}, top_k={self.top_k}: truncated sampling makes rollout logprobs those of "
                "the truncated distribution, which no longer match the learner's log_softmax(logits/T); "
                "set return_support=True (an engine that returns the sampling support, e.g. vLLM), or top_p=1.0, "
                "top_k=-1, or allow_truncated_sampling=True if you accept the mismatch")

    @property
    def truncated(self) -> bool:
        """True for top-k / top-p sampling (the support is not the whole vocabulary)."""
        return self.top_p != 1.0 or self.top_k != -1

    def seed_for(self, prompt_index: int, sample_index: int = 0) -> int | None:
        """The seed of sample `sample_index` of prompt `prompt_index`: seed + i·n + j (None: unseeded)."""
        if self.seed is None:
            return None
        return self.seed + prompt_index * self.n + sample_index


@dataclasses.dataclass
class Rollout:
    """One sampled response. `response_logprobs[t]` is the logprob of `response_token_ids[t]` (see module doc)."""

    prompt_index: int  # index into the `prompt_token_ids` passed to `generate`
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token, included in the response) | "length" (max_tokens hit);
                        # of a multi-turn trajectory: its last turn's
    # Per response token, the ids of the support it was sampled from (`SamplingConfig.return_support`);
    # None: the whole vocabulary.
    sampling_support: list[list[int]] | None = None
    # Set by the multi-turn driver (rl/turns.py), never by an engine: the response is then the whole trajectory
    # after the prompt, the model's turns and the observations between them. Per response token, 1 where the
    # engine sampled it, 0 where an environment inserted it (whose logprob is then 0); None: all sampled.
    response_mask: list[int] | None = None
    # Per response token, the turn it belongs to (an observation: the turn it answers); None: all turn 0.
    turn_index: list[int] | None = None
    # np.ndarray [len(prompt) + len(response) - 1, layers, top_k] of expert ids
    # (`SamplingConfig.return_routed_experts`, module doc "Routed experts"); None: not asked for.
    routed_experts: "np.ndarray | None" = None  # noqa: F821  (numpy: only adapters that fill it need it)

    def __post_init__(self):
        if len(self.response_token_ids) != len(self.response_logprobs):
            raise ValueError(f"{len(self.response_token_ids)} response tokens but "
                             f"{len(self.response_logprobs)} logprobs")
        if self.sampling_support is not None and len(self.sampling_support) != len(self.response_token_ids):
            raise ValueError(f"{len(self.response_token_ids)} response tokens but a sampling support for "
                             f"{len(self.sampling_support)}")
        for name in ("response_mask", "turn_index"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.response_token_ids):
                raise ValueError(f"{len(self.response_token_ids)} response tokens but a {name} of {len(values)}")
        if self.routed_experts is not None and (
                len(self.routed_experts) != len(self.prompt_token_ids) + len(self.response_token_ids) - 1):
            raise ValueError(f"routed_experts has {len(self.routed_experts)} rows; expected one per position but "
                             f"the last: {len(self.prompt_token_ids) + len(self.response_token_ids) - 1}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r}; expected one of {FINISH_REASONS}")


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """One request to `EngineAdapter.serve`: `sampling.n` samples of `prompt_token_ids`, sample j seeded
    `sampling.seed + j`. `key` is the caller's (the multi-turn driver: its first trajectory's index)."""

    key: int
    prompt_token_ids: list[int]
    sampling: SamplingConfig


Finished = list[tuple[Request, list[Rollout]]]  # what `serving` yields: finished requests with their rollouts


def _waves(requests: Sequence[Request]) -> list[list[Request]]:
    """The requests grouped by sampling, seeds and max_tokens aside (first-seen order), seeded and unseeded
    apart: each group is one `generate` call of the default `serve`."""
    groups: dict = {}
    for r in requests:
        fields = dataclasses.asdict(r.sampling)
        fields.update(seed=r.sampling.seed is None, max_tokens=None)
        groups.setdefault(tuple(fields.items()), []).append(r)
    return list(groups.values())


def _batch_seeds(seeds: list[int | None], n: int) -> dict:
    """`generate`'s seed arguments for prompts with these sample-0 seeds: none when the batch rule gives them
    (seed + i·n: the call a one-shot caller makes), else `seeds`."""
    if seeds[0] is None or all(s == seeds[0] + i * n for i, s in enumerate(seeds)):
        return {}
    return {"seeds": seeds}


def _cut(rollout: Rollout, max_tokens: int) -> Rollout:
    """`rollout` with at most `max_tokens` response tokens (cut: finish_reason "length")."""
    if len(rollout.response_token_ids) <= max_tokens:
        return rollout
    routed = rollout.routed_experts
    return dataclasses.replace(
        rollout, response_token_ids=rollout.response_token_ids[:max_tokens],
        response_logprobs=rollout.response_logprobs[:max_tokens], finish_reason="length",
        sampling_support=None if rollout.sampling_support is None else rollout.sampling_support[:max_tokens],
        routed_experts=None if routed is None else routed[:len(rollout.prompt_token_ids) + max_tokens - 1])


def prompt_seeds(sampling: SamplingConfig, seeds: Sequence[int] | None, num_prompts: int) -> list[int | None]:
    """Per prompt the seed of its sample 0: `seeds` (checked) or the batch rule `sampling.seed_for(i)`."""
    if seeds is None:
        return [sampling.seed_for(i) for i in range(num_prompts)]
    if len(seeds) != num_prompts:
        raise ValueError(f"{len(seeds)} seeds for {num_prompts} prompts; pass one per prompt")
    return [int(s) for s in seeds]


def drive(session: Generator[Finished, Sequence[Request], None],
          respond: Callable[[Finished], Sequence[Request]]) -> None:
    """Runs a serving session (an adapter's `serving(requests)`) to its end: each batch of finished requests
    goes to `respond`, whose requests are sent back. Closes the session if `respond` raises, so the engine
    drops what is still running."""
    with contextlib.closing(session):
        finished = next(session, None)
        while finished is not None:
            following = list(respond(finished))
            try:
                finished = session.send(following)
            except StopIteration:
                finished = None


def in_waves(engine: "EngineAdapter", requests: Sequence[Request]) -> Generator[Finished, Sequence[Request], None]:
    """Serving in waves over `engine.generate` (the default `serving`; module doc, "Serving"): one generate call
    per distinct sampling over all the requests at hand, then one batch with every one of them, in request
    order."""
    pending = list(requests)
    while pending:
        finished = []
        for group in _waves(pending):
            first = group[0].sampling
            rollouts = engine.generate(
                [r.prompt_token_ids for r in group],
                dataclasses.replace(first, max_tokens=max(r.sampling.max_tokens for r in group)),
                **_batch_seeds([r.sampling.seed for r in group], first.n))
            finished += [(r, [_cut(x, r.sampling.max_tokens) for x in rollouts[i * first.n:(i + 1) * first.n]])
                         for i, r in enumerate(group)]
        order = {id(r): i for i, r in enumerate(pending)}
        finished.sort(key=lambda pair: order[id(pair[0])])
        pending = list((yield finished))


NamedTensor = Tuple[str, "torch.Tensor"]  # noqa: F821  (torch is only needed by concrete adapters)

def named_tensor_pairs(named_tensors: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
    """The push contract, checked lazily: yields the `(hf_name, tensor)` pairs of `update_weights`' argument
    (ONE flat iterable, possibly a one-shot generator; each adapter buckets for its own transport). Anything
    else, a list of pairs (a bucket) included, is a TypeError naming the fix."""
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"update_weights takes a flat iterable of (hf_name, tensor) pairs, got an item of type "
                            f"{type(item).__name__}; e.g. engine.update_weights(convert.to_torch.iter_hf_tensors(...))")
        yield item


def check_prompts(prompt_token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """Validates a batch of token-id prompts and returns it as lists of ints."""
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
        raise TypeError("prompt_token_ids must be a sequence of token-id sequences (a batch), e.g. [[1, 2, 3]]")
    prompts = []
    for i, p in enumerate(prompt_token_ids):
        if isinstance(p, int) or len(p) == 0:
            raise ValueError(f"prompt {i} must be a non-empty sequence of token ids "
                             "(pass a batch: [[ids...], ...])")
        prompts.append([int(t) for t in p])
    return prompts


class EngineAdapter(abc.ABC):
    """A rollout engine. Subclasses implement `generate`, `update_weights`, `close`, and set `quantization`.

    `quantization` (str | None) is part of the contract (module doc): None for an engine serving the pushed
    weights unquantized, else the scheme's name. `registry.create_engine` closes an adapter that does not set
    it and raises a TypeError naming the fix.
    """

    quantization: str | None  # set by every adapter (class attribute, property or in __init__)
    # The longest prompt + response in tokens the engine serves (module doc, "Length"); None: not known.
    max_model_len: int | None = None
    # True when `generate` honours `SamplingConfig.return_support` (fills `Rollout.sampling_support`).
    returns_sampling_support: bool = False
    # True when `generate` honours `SamplingConfig.return_routed_experts` (fills `Rollout.routed_experts`).
    returns_routed_experts: bool = False

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Refuses settings this adapter cannot honour (one line naming the fix); adapters call it in generate."""
        if sampling.return_support and not self.returns_sampling_support:
            raise ConfigError(
                f"{type(self).__name__} cannot return the sampling support that top_p={sampling.top_p} / "
                f"top_k={sampling.top_k} need for exact logprobs; use an engine that can (vLLM), or top_p=1.0, "
                "top_k=-1")
        if sampling.return_routed_experts and not self.returns_routed_experts:
            raise ConfigError(
                f"{type(self).__name__} does not return the experts it routed each token to (routing replay); "
                "start a vLLM engine with return_routed_experts=True on an MoE checkpoint, or turn replay off")

    @abc.abstractmethod
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 seeds: Sequence[int] | None = None) -> list[Rollout]:
        """Returns `n` rollouts per prompt in prompt-major order (prompt 0's n samples first). `seeds`: per
        prompt, the seed of its sample 0 (module doc, "Seeds"); None: `sampling.seed_for(i)`."""

    def serve(self, requests: Sequence[Request], respond: Callable[[Finished], Sequence[Request]]) -> None:
        """Generates `requests` and whatever `respond` returns for the finished ones, until none is left
        (module doc, "Serving"): `drive(self.serving(requests), respond)`."""
        drive(self.serving(requests), respond)

    def serving(self, requests: Sequence[Request]) -> Generator[Finished, Sequence[Request], None]:
        """Yields each batch of finished requests with their rollouts and is sent the requests that follow
        them (module doc, "Serving"). This default serves `in_waves`."""
        return in_waves(self, requests)

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[NamedTensor]) -> None:
        """A full sync from ONE flat iterable of `(hf_name, torch.Tensor)` pairs (module doc, "Push").

        The iterable may be a one-shot generator (the learner's export yields one parameter at a time) and
        is read once; the adapter groups the pairs for its own transport (vLLM: one reload of all of them,
        SGLang: buckets that keep q/k/v and gate/up together, the Ray fleet: object-store buckets).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Frees the engine. Idempotent."""

    def sleep(self) -> None:
        """Optionally releases accelerator memory between rollout phases (no-op by default)."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undoes `sleep` (no-op by default). `tags` (vLLM's): ["weights"] brings back only the weight memory
        (for a push), ["kv_cache"] then the KV cache; None: everything. An adapter that cannot wake in parts
        may omit `tags` from its signature; the loop then wakes it whole (rl/colocation.py)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
