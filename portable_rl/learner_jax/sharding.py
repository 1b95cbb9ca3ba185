"""Sharded learner with JAX's own sharding: a 3-axis device mesh, logical axis rules, GSPMD.

Scheme (T5X / MaxText style, on the unchanged model and train step):

    mesh        = devices arranged as [data, fsdp, expert, tensor]               (MeshConfig)
    parameter   → logical axes per dimension   (PARAM_LOGICAL_AXES, by NNX path)
    logical axis → mesh axes                   (LOGICAL_AXIS_RULES)
    spec        = PartitionSpec(mesh axes per dimension) → NamedSharding(mesh, spec)

`shard_model_and_optimizer` puts every parameter (and the AdamW moments, which mirror the parameter
shapes; scalar counters are replicated) on its NamedSharding with `jax.device_put`; `shard_batch`
splits the rows of a [B, ...] batch over ("data", "fsdp"). The jitted `step.make_train_step`
(nnx.jit) is not changed: XLA's GSPMD partitioner propagates the input shardings through the
forward, backward and optimizer update, and inserts the all-gathers / reduce-scatters.

    data    pure data parallelism: params replicated, batch rows split
    fsdp    ZeRO-3: batch rows split AND the `embed` dimension of every matrix split (params, grads,
            moments are 1/fsdp per device; weights are all-gathered just in time)
    tensor  Megatron-style: heads / mlp / vocab dimensions split; activations of those dims stay split
    expert  expert parallelism (MoE models): batch rows split like fsdp, and the experts dimension of the
            stacked expert weights split; the MoE layers exchange tokens inside a shard_map
            (learner_jax/moe.py, `Experts`). Must divide the expert count.

A dimension that does not divide its mesh axes' size is replicated instead (so a tiny model runs on
any mesh); the result is the same, only the memory saving is lost for that dimension.

Weight export: a sharded (multi-device) array cannot be handed to torch with DLPack;
`gather_for_export` gathers one parameter onto one device (or to host memory on TPU / multi-host),
and `convert.hf.cast_params` calls it, so the weight push works unchanged on a sharded learner.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from portable_rl.errors import ConfigError

_log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axis → mesh axes (a name, a tuple of names, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch",    ("data", "fsdp", "expert")),  # rows of a batch; activations follow by propagation
    ("experts",  "expert"),           # the E dimension of stacked MoE expert weights
    ("embed",    "fsdp"),             # the hidden-size dimension of every matrix (ZeRO-3 split)
    ("vocab",    "tensor"),
    ("heads",    "tensor"),           # num_heads * head_dim (head-major, so the split is by heads)
    ("kv_heads", "tensor"),
    ("mlp",      "tensor"),
    ("head_dim", None),               # q/k RMSNorm gains [head_dim]
    ("norm",     None),               # RMSNorm gains and [hidden] biases: small, replicated
)

# NNX parameter path (matched at the END of a state path, so the AdamW moments `...mu.<path>` match
# too; `*` = layer index) → logical axis per dimension. Kernels are [in, out] (model.py).
PARAM_LOGICAL_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("embed.embedding",               ("vocab", "embed")),       # [V, D]  (also the tied lm_head)
    ("layers.*.input_norm.scale",     ("norm",)),                # [D]
    ("layers.*.attn.q_proj.kernel",   ("embed", "heads")),       # [D, N*H]
    ("layers.*.attn.k_proj.kernel",   ("embed", "kv_heads")),    # [D, K*H]
    ("layers.*.attn.v_proj.kernel",   ("embed", "kv_heads")),    # [D, K*H]
    ("layers.*.attn.o_proj.kernel",   ("heads", "embed")),       # [N*H, D]
    ("layers.*.attn.q_proj.bias",     ("heads",)),               # [N*H]   (qwen2, attention_bias)
    ("layers.*.attn.k_proj.bias",     ("kv_heads",)),            # [K*H]
    ("layers.*.attn.v_proj.bias",     ("kv_heads",)),            # [K*H]
    ("layers.*.attn.o_proj.bias",     ("norm",)),                # [D]     (attention_bias, not qwen2)
    ("layers.*.attn.q_norm.scale",    ("head_dim",)),            # [H]     (qwen3)
    ("layers.*.attn.k_norm.scale",    ("head_dim",)),            # [H]
    ("layers.*.post_attn_norm.scale", ("norm",)),                # [D]
    ("layers.*.mlp.gate_proj.kernel", ("embed", "mlp")),         # [D, F]
    ("layers.*.mlp.up_proj.kernel",   ("embed", "mlp")),         # [D, F]
    ("layers.*.mlp.down_proj.kernel", ("mlp", "embed")),         # [F, D]
    ("layers.*.mlp.router.kernel",    ("embed", None)),          # [D, E]  (MoE layers)
    ("layers.*.mlp.experts.gate_proj", ("experts", "embed", "mlp")),  # [E, D, F]
    ("layers.*.mlp.experts.up_proj",   ("experts", "embed", "mlp")),  # [E, D, F]
    ("layers.*.mlp.experts.down_proj", ("experts", "mlp", "embed")),  # [E, F, D]
    ("layers.*.mlp.shared_expert.gate_proj.kernel", ("embed", "mlp")),  # [D, F_s]  (qwen2_moe)
    ("layers.*.mlp.shared_expert.up_proj.kernel",   ("embed", "mlp")),  # [D, F_s]
    ("layers.*.mlp.shared_expert.down_proj.kernel", ("mlp", "embed")),  # [F_s, D]
    ("layers.*.mlp.shared_expert_gate.kernel",      ("embed", None)),   # [D, 1]
    ("final_norm.scale",              ("norm",)),                # [D]
    ("lm_head.kernel",                ("embed", "vocab")),       # [D, V]  (untied only)
)


# ------------------------------------------------------------------------------------------ mesh
@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh sizes; -1 on one axis takes the remaining devices (default: all of them on fsdp).

    The product of the sizes (after filling the -1) must equal the number of devices.

    Attributes:
      data: devices of the data-parallel axis (params replicated, batch rows split); -1: the remaining ones.
      fsdp: devices of the ZeRO-3 axis (batch rows and every matrix's embed dimension split); -1: the
        remaining ones.
      expert: devices of the expert-parallel axis (MoE models: batch rows and the experts split; must divide
        the expert count); -1: the remaining ones.
      tensor: devices of the tensor-parallel axis (heads, mlp and vocab dimensions split); -1: the remaining
        ones.
    """
    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = dataclasses.astuple(self)
        if any(not isinstance(s, int) or (s < 1 and s != -1) for s in sizes):
            raise ConfigError(f"MeshConfig sizes must be positive ints or -1, got {self}")
        if sizes.count(-1) > 1:
            raise ConfigError(f"MeshConfig: at most one axis may be -1 (fill), got {self}")


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int, int]:
    """(data, fsdp, expert, tensor) with the -1 axis filled; their product is `num_devices`."""
    sizes = list(dataclasses.astuple(cfg))
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(f"mesh {cfg}: the fixed axes ({known} devices) do not divide the "
                              f"{num_devices} devices; choose sizes whose product divides {num_devices}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(f"mesh {cfg} needs data*fsdp*expert*tensor = {math.prod(sizes)} devices but there are "
                          f"{num_devices}; set one axis to -1 or pass devices= with that many devices")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices: Sequence | None = None) -> Mesh:
    """A ("data", "fsdp", "expert", "tensor") mesh over `devices` (default: all devices of all processes).

    Axis types are Auto: shardings are propagated by GSPMD, so unannotated code (the model, optax)
    runs as is.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


# --------------------------------------------------------------------------------- logical → spec
def _mesh_axes(rules, logical: str | None) -> tuple[str, ...]:
    if logical is None:
        return ()
    rules = dict(rules)
    if logical not in rules:
        raise KeyError(f"logical axis {logical!r} has no sharding rule; add it to the rules "
                       f"(known: {', '.join(rules)})")
    target = rules[logical]
    return () if target is None else ((target,) if isinstance(target, str) else tuple(target))


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules=LOGICAL_AXIS_RULES) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dimensions carry `logical_axes`.

    Mesh axes of size 1 are left out of the spec. A dimension is replicated when its size does not
    divide the product of its mesh axes' sizes (NamedSharding needs even shards; tiny models then
    still run on any mesh), or when one of its mesh axes is already used by an earlier dimension
    (a mesh axis can split only one dimension).
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"{len(logical_axes)} logical axes {tuple(logical_axes)} for an array of shape {tuple(shape)}")
    used, spec = set(), []
    for logical, size in zip(logical_axes, shape):
        axes = tuple(a for a in _mesh_axes(rules, logical) if mesh.shape[a] > 1)  # size-1 axes split nothing
        ways = math.prod(mesh.shape[a] for a in axes)
        if not axes or size % ways or used & set(axes):
            spec.append(None)
            continue
        used |= set(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def _compile_param_table(table) -> list[tuple[re.Pattern, tuple]]:
    out = []
    for pattern, axes in table:
        regex = r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in pattern.split("."))
        out.append((re.compile(rf"(?:^|\.){regex}$"), tuple(axes)))
    return out


_PARAM_TABLE = _compile_param_table(PARAM_LOGICAL_AXES)


def param_logical_axes(path: str, ndim: int, table=None) -> tuple[str | None, ...] | None:
    """Logical axes of the state entry at dotted `path` ("layers.0.attn.q_proj.kernel", or the same
    path under an optimizer moment); None when no table row matches or the rank differs (scalars)."""
    for regex, axes in (_PARAM_TABLE if table is None else _compile_param_table(table)):
        if regex.search(path) and len(axes) == ndim:
            return axes
    return None


def _dotted(keypath) -> str:
    parts = []
    for k in keypath:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        parts.append(str(key))
    if parts and parts[-1] == "value":  # nnx.Variable's pytree child
        parts.pop()
    return ".".join(parts)


def state_shardings(state, mesh: Mesh, rules=LOGICAL_AXIS_RULES, *, table=None):
    """NamedSharding for every array leaf of an nnx State (model or optimizer), same tree structure."""
    def sharding(keypath, x):
        path = _dotted(keypath)
        axes = param_logical_axes(path, np.ndim(x), table)
        if axes is None:
            if np.ndim(x) >= 2:  # an unlisted matrix: correct when replicated, but not memory-split
                _log.warning("no sharding rule for %s %s; replicating it", path, np.shape(x))
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, logical_to_spec(axes, np.shape(x), mesh, rules))
    return jax.tree_util.tree_map_with_path(sharding, state)


def shard_module(module, mesh: Mesh, rules=LOGICAL_AXIS_RULES, *, table=None) -> None:
    """Moves every variable of `module` (an nnx Module or Optimizer) onto its NamedSharding, in place."""
    state = nnx.state(module)
    shardings = state_shardings(state, mesh, rules, table=table)
    nnx.update(module, jax.device_put(state, shardings))


def shard_model_and_optimizer(model, optimizer=None, mesh: Mesh | None = None, rules=LOGICAL_AXIS_RULES,
                              *, table=None) -> None:
    """Shards `model` params and (if given) the `nnx.Optimizer` state over `mesh`, in place.

    Call before the first train step (re-call after replacing arrays wholesale, e.g. a restore
    that does not keep shardings). The jitted train step then runs sharded via GSPMD.
    """
    if mesh is None:
        raise ValueError("shard_model_and_optimizer needs a mesh; build one with make_mesh(MeshConfig(...))")
    shard_module(model, mesh, rules, table=table)
    if optimizer is not None:
        shard_module(optimizer, mesh, rules, table=table)


# ------------------------------------------------------------------------------------------ batch
def batch_shards(mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> int:
    """How many ways the rows of a batch are split (the product of the "batch" mesh axes)."""
    return math.prod(mesh.shape[a] for a in _mesh_axes(rules, "batch"))


def shard_batch(batch: Mapping, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> dict:
    """Puts every [B, ...] array of `batch` on the mesh, rows split over the "batch" axes
    (("data", "fsdp")); other entries (scalars) pass through.

    With several processes every process must hold the same full batch: each one supplies the
    rows of its own devices (`jax.make_array_from_callback`).
    """
    axes = _mesh_axes(rules, "batch")
    ways = batch_shards(mesh, rules)
    out = {}
    for name, x in batch.items():
        if not isinstance(x, (np.ndarray, jax.Array)) or np.ndim(x) == 0:
            out[name] = x
            continue
        if x.shape[0] % ways:
            raise ValueError(f"batch[{name!r}] has {x.shape[0]} rows, not a multiple of the {ways} batch "
                             f"shards ({'×'.join(axes)}); make the mini-batch rows a multiple of {ways}")
        sharding = NamedSharding(mesh, PartitionSpec(axes if len(axes) > 1 else axes[0]))
        if isinstance(x, jax.Array):
            out[name] = jax.device_put(x, sharding)
        else:
            out[name] = jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx])
    return out


def constrain_batch_rows(x, rules=LOGICAL_AXIS_RULES):
    """`x` [B, ...] (inside jit) pinned to rows split over the "batch" mesh axes, when a mesh is set
    with `jax.set_mesh(mesh)` around the jitted call; unchanged without one (or when B does not divide).

    Why (the model calls it on the residual stream at every layer boundary): propagation alone
    sometimes resolves a dot of row-split activations with fsdp-split weights by gathering the
    activations' rows instead of the weight, so every device computes every device's tokens
    (measured, Qwen3-8B widths, 2 layers, 1024 tokens per device, fsdp=8: the [8184, V] logits of all
    devices on each one; 13.4 GB of temporaries instead of 7.2 GB; benchmarks/learner_memory.py).
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else _split_batch_axes(mesh, rules)
    if not axes or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes if len(axes) > 1 else axes[0]))


def _split_batch_axes(mesh, rules=LOGICAL_AXIS_RULES) -> tuple[str, ...]:
    return tuple(a for a in _mesh_axes(rules, "batch") if a in mesh.axis_names and mesh.shape[a] > 1)


def expert_parallel_size() -> int:
    """Devices of the `expert` axis of the mesh set with `jax.set_mesh` (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "expert" not in mesh.axis_names else mesh.shape["expert"]


def row_spec(rules=LOGICAL_AXIS_RULES) -> PartitionSpec:
    """PartitionSpec of [rows, ...] arrays split over the set mesh's batch axes (a shard_map's in/out spec)."""
    axes = _split_batch_axes(jax.sharding.get_abstract_mesh(), rules)
    return PartitionSpec(axes if len(axes) > 1 else (axes[0] if axes else None))


def pad_rows(x: np.ndarray, multiple: int) -> np.ndarray:
    """`x` with all-zero rows appended up to a multiple of `multiple` rows."""
    extra = -x.shape[0] % multiple
    return np.concatenate([x, np.zeros((extra, *x.shape[1:]), x.dtype)]) if extra else x


# ---------------------------------------------------------------------------------- gather / host
def to_host(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-process) array as one numpy array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def gather_for_export(x):
    """`x` as a single-device array that DLPack can hand to torch; single-device arrays are returned
    as they are (zero copy).

    - replicated on several local devices: the first local copy (zero copy);
    - sharded over local devices: gathered onto the first device that holds a shard (one parameter
      at a time, so the peak extra memory is one full parameter);
    - spread over several processes: `process_allgather` (every process must call this, in the same
      order) and placed on a local device;
    - TPU arrays go to the host CPU device (torch has no TPU tensors).
    """
    if not isinstance(x, jax.Array):
        return x
    devices = x.sharding.device_set
    platform = next(iter(devices)).platform
    target = jax.local_devices(backend="cpu")[0] if platform == "tpu" else None
    if len(devices) == 1 and target is None:
        return x
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        host = multihost_utils.process_allgather(x, tiled=True)
        return jax.device_put(host, target or jax.local_devices(backend=platform)[0])
    if x.is_fully_replicated:
        x = x.addressable_shards[0].data
        return x if target is None else jax.device_put(x, target)
    return jax.device_put(x, target or x.addressable_shards[0].device)
