"""The engine-adapter interface: plain data in, plain data out.

An adapter wraps one rollout engine (vLLM, SGLang, or anything registered through
`portable_rl.engines.registry`). The learner talks to it with token ids and `(hf_name, torch.Tensor)`
pairs only, so engines never see JAX and the learner never sees an engine object.

The one definition of a rollout logprob (docs/architecture.md):

    response_logprobs[t] = log_softmax(logits_t / T)[response_token_ids[t]]      (float32, natural log)

i.e. the log-probability of the sampled token under the full-vocabulary tempered distribution it was
sampled from. Top-k / top-p truncation would change that distribution, so `SamplingConfig` rejects them
unless `allow_truncated_sampling=True` is set explicitly (then logprobs are those of the truncated,
renormalised distribution and no longer match the learner's).

Seeds. Sample j of prompt i in a batch gets the seed

    seed_ij = seed + i·n + j                                    (`SamplingConfig.seed_for(i, j)`)

so a prompt's samples do not depend on what else is in the batch, and a shard of the batch starting at
prompt s is the same as the whole batch with seed + s·n (the Ray fleet relies on this).

Quantization. Every adapter reports `quantization`: None when it serves the pushed weights in their own
dtype (bf16), else the name of the scheme it serves (e.g. "fp8_per_channel", "fp8_blockwise",
"fake_mxfp4"). The post-sync probe judges a quantized engine by its report, not by the bf16 bound.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Iterable, Iterator, Sequence, Tuple, Union

FINISH_REASONS = ("stop", "length")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample. `temperature=0` is greedy (logprobs are then those of the untempered softmax)."""

    temperature: float = 1.0
    max_tokens: int = 64
    n: int = 1  # samples per prompt
    seed: int | None = None  # same seed + same weights → same samples
    stop_token_ids: Tuple[int, ...] = ()
    top_p: float = 1.0
    top_k: int = -1
    # Opt-in escape hatch: top-p / top-k make rollout logprobs differ from the learner's definition.
    allow_truncated_sampling: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        truncated = self.top_p != 1.0 or self.top_k != -1
        if truncated and not self.allow_truncated_sampling:
            raise ValueError(
                f"top_p={self.top_p}, top_k={self.top_k}: truncated sampling makes rollout logprobs those of "
                "the truncated distribution, which no longer match the learner's log_softmax(logits/T); "
                "use top_p=1.0, top_k=-1, or set allow_truncated_sampling=True if you accept the mismatch")

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
    finish_reason: str  # "stop" (EOS or a stop token, included in the response) | "length" (max_tokens hit)

    def __post_init__(self):
        if len(self.response_token_ids) != len(self.response_logprobs):
            raise ValueError(f"{len(self.response_token_ids)} response tokens but "
                             f"{len(self.response_logprobs)} logprobs")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r}; expected one of {FINISH_REASONS}")


NamedTensor = Tuple[str, "torch.Tensor"]  # noqa: F821  (torch is only needed by concrete adapters)
NamedTensors = Union[Iterable[NamedTensor], Iterable[Sequence[NamedTensor]]]


def flatten_named_tensors(named_tensors: NamedTensors) -> Iterator[NamedTensor]:
    """Yields (name, tensor) pairs from either a flat iterable of pairs or an iterable of buckets of pairs."""
    for item in named_tensors:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        else:  # a bucket: list of pairs
            for pair in item:
                if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
                    raise TypeError(f"expected (hf_name, tensor) pairs or buckets of them, got {type(pair)}")
                yield pair


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
    weights unquantized, else the scheme's name. `registry.create_engine` fills in None, with a warning, for
    an out-of-tree adapter that predates it.
    """

    quantization: str | None  # set by every adapter (class attribute, property or in __init__)

    @abc.abstractmethod
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Rollout]:
        """Returns `n` rollouts per prompt in prompt-major order (prompt 0's n samples first)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: NamedTensors) -> None:
        """Loads new weights given as `(hf_name, torch.Tensor)` pairs (or buckets of them); a full sync."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees the engine. Idempotent."""

    def sleep(self) -> None:
        """Optionally releases accelerator memory between rollout phases (no-op by default)."""

    def wake_up(self) -> None:
        """Undoes `sleep` (no-op by default)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
