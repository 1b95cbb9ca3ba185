"""XLA:CPU's stand-in for the GPU's grouped matmul, for memory planning only.

The MoE layers (learner_jax/moe.py) run each expert matmul as one `jax.lax.ragged_dot`: rows x [M, K] sorted by
expert, weights w [G, K, N], group_sizes [G]. XLA:GPU and TPU compile it as one ragged dot (`chlo.ragged_dot`):
its memory is its operands and its [M, N] output. XLA:CPU has no ragged dot (its emitter refuses the opcode),
so JAX lowers it there densely, each row masked into every group's copy:

    dense CPU lowering   [G, M, K] masked rows → [G, M, N] products → summed over G   (G times the output)

For Qwen3-30B-A3B (G = 128 experts) at 16k tokens per device that is ~69 GB of temporaries for one 0.4 GB
matmul, so a CPU compile would plan an MoE update the GPU never runs. While planning
(`planning.learner_peak.predict_update_memory`), `grouped_matmul_stand_in()` lowers ragged dots on CPU as a
batched matmul over equal groups instead, the same operand, output and gradient shapes as the GPU's:

    forward / d rows     x [M, K] → [G, ⌈M/G⌉, K] (zero-padded), · w [G, K, N] → [G, ⌈M/G⌉, N] → [M, N]
    d weights            x [M, K], dy [M, N] → [G, ⌈M/G⌉, ·] each, contracted → [G, K, N]

It equals the ragged dot only when every group holds ⌈M/G⌉ rows (tests/test_plan.py checks that case and the
memory); its values are never used: the planner compiles abstract shapes and runs nothing. Outside the
context the CPU lowering is JAX's own again.
"""

from __future__ import annotations

import contextlib

import numpy as np


def _equal_groups(x, dim: int, groups: int):
    """x with dimension `dim` (size M) zero-padded to a multiple of G and split into a leading [G, ⌈M/G⌉]."""
    import jax.numpy as jnp

    m = x.shape[dim]
    pad = (-m) % groups
    if pad:
        x = jnp.pad(x, [(0, pad) if d == dim else (0, 0) for d in range(x.ndim)])
    x = x.reshape(x.shape[:dim] + (groups, (m + pad) // groups) + x.shape[dim + 1:])
    return jnp.moveaxis(x, dim, 0)


def equal_groups_ragged_dot(lhs, rhs, group_sizes, *, ragged_dot_dimension_numbers, precision=None,
                            preferred_element_type=None, group_offset=None, out_sharding=None):
    """`ragged_dot_general` as if every group held ⌈M/G⌉ rows (module doc): 2-D rows, no batch dimensions."""
    from jax import lax

    (l_contract, r_contract), (l_batch, r_batch) = ragged_dot_dimension_numbers.dot_dimension_numbers
    (ragged,) = ragged_dot_dimension_numbers.lhs_ragged_dimensions
    if l_batch or r_batch or lhs.ndim != 2 or group_offset is not None:
        raise NotImplementedError(f"the planner's ragged-dot stand-in takes 2-D rows without batch dimensions; "
                                  f"got lhs {lhs.shape}, {ragged_dot_dimension_numbers}")
    groups, m = group_sizes.shape[0], lhs.shape[ragged]
    shift = lambda dims: tuple(d + 1 for d in dims)  # noqa: E731  (dims after the leading G)
    x = _equal_groups(lhs, ragged, groups)                               # [G, ..., ⌈M/G⌉ at ragged + 1, ...]
    if ragged not in l_contract:   # rows x groups' weights → rows: the forward and the rows' gradient
        (group_dim,) = ragged_dot_dimension_numbers.rhs_group_dimensions
        rhs_contract = tuple(d - (d > group_dim) for d in r_contract)
        w = np.moveaxis(np.arange(rhs.ndim), group_dim, 0)
        out = lax.dot_general(x, lax.transpose(rhs, tuple(int(i) for i in w)),
                              ((shift(l_contract), shift(rhs_contract)), ((0,), (0,))),
                              precision=precision, preferred_element_type=preferred_element_type)
        out = out.reshape((-1,) + out.shape[2:])                         # [G·⌈M/G⌉, N]
        return out[:m]
    # rows contracted → per-group products [G, lhs free, rhs free]: the weights' gradient
    r_ragged = r_contract[l_contract.index(ragged)]
    y = _equal_groups(rhs, r_ragged, groups)
    return lax.dot_general(x, y, ((shift(l_contract), shift(r_contract)), ((0,), (0,))),
                           precision=precision, preferred_element_type=preferred_element_type)


@contextlib.contextmanager
def grouped_matmul_stand_in():
    """Within: ragged dots lower on CPU as `equal_groups_ragged_dot` (module doc); after: JAX's own lowering."""
    from jax._src.interpreters import mlir
    from jax._src.lax import lax as lax_internal

    primitive = lax_internal.ragged_dot_general_p
    table = mlir._platform_specific_lowerings["cpu"]
    previous = table.get(primitive)
    mlir.register_lowering(primitive, mlir.lower_fun(equal_groups_ragged_dot, multiple_results=False),
                           platform="cpu", cacheable=False)
    try:
        yield
    finally:
        if previous is None:
            table.pop(primitive, None)
        else:
            table[primitive] = previous
