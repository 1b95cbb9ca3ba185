"""JAX/Flax NNX learner: the policy model, logprobs, optimizer, train step and checkpoints.

Never imports torch (see docs/architecture.md).
"""

from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.logprobs import sequence_logprobs, token_logprobs
from portable_rl.learner_jax.model import Transformer

__all__ = ["ModelConfig", "Transformer", "sequence_logprobs", "token_logprobs"]
