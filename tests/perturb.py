"""A stand-in for a training step in tests: every parameter of an NNX model moved by random noise."""

import jax
from flax import nnx


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of `model` with every parameter moved by `scale` · N(0, 1) noise (seeded)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
