"""Device mesh and the one rules table that maps logical axis names onto mesh axes.

The mesh has the axes MESH_AXES, (data, fsdp, tensor, sequence, expert), the one list of
them that everything else (configs, the planner's sweep) is derived from:
  data     — pure data parallelism (replicated weights);
  fsdp     — data parallelism with weights and optimizer state sharded (ZeRO-3 style);
  tensor   — Megatron-style tensor parallelism over heads, MLP width and vocabulary;
  sequence — context parallelism: each row's positions are split over it, so one long
             row spans several devices. Attention gathers the keys and values of the
             whole row (`muajax.models.attention`); everything else is per position.
             Weights are sharded over it as over fsdp (it holds different data).
  expert   — expert parallelism for mixture-of-experts layers: each device holds
             E / expert of the experts' weights ("exp" axis), and tokens travel to their
             experts' devices and back by all-to-all (`muajax.models.moe_dispatch`).
             Everything outside the experts treats it as data parallelism, as MaxText's
             expert axis does: it splits the batch, and the other weights are sharded
             over it as over fsdp. On a dense model it is one more data axis.
Batches are split over (data, fsdp, expert). A dimension that a mesh axis does not divide
evenly stays replicated on that axis (e.g. 2 kv heads on tensor=4), so every model runs
on every mesh; `describe_layout` shows what was actually sharded.
"""
from __future__ import annotations

import contextlib
import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

# `sequence` and `expert` come last so that calls naming (data, fsdp, tensor) by position
# keep their meaning (an axis left out is 1); it also puts the axes whose collectives run
# every layer (sequence's all-gathers, expert's all-to-alls) on the closest devices.
MESH_AXES = ("data", "fsdp", "tensor", "sequence", "expert")
EXPERT_AXIS = "expert"
BATCH_AXES = ("data", "fsdp", EXPERT_AXIS)
SEQUENCE_AXIS = "sequence"
# Weights and optimizer state are sharded over every axis that holds different data (an
# expert weight's "exp" dimension takes the expert axis first: see `logical_to_spec`).
WEIGHT_AXES = ("fsdp", SEQUENCE_AXIS, EXPERT_AXIS)

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", BATCH_AXES),
    ("activation_length", SEQUENCE_AXIS),
    # batch and length flattened into one axis of tokens (the LM head's rows)
    ("activation_tokens", BATCH_AXES + (SEQUENCE_AXIS,)),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("vocab", "tensor"),
    # The embedding table is read by a gather: sharding its rows would make XLA replicate
    # it anyway (an "involuntary full rematerialization"), so only its width is sharded.
    ("embed_vocab", None),
    ("embed", WEIGHT_AXES),
    # the embedding table as its lookup reads it (see Qwen3): width over the batch axes that
    # shard weights, so its rows move to the batch split by one all-to-all
    ("embed_lookup", ("fsdp", EXPERT_AXIS)),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    # mixture-of-experts weights [E, D, F]: experts over the expert axis, F like the MLP's
    ("exp", EXPERT_AXIS),
    ("moe_mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
    ("cache_batch", BATCH_AXES),
    ("cache_length", None),
    ("cache_kv_heads", "tensor"),
)


def resolve_mesh_shape(*sizes_then_devices: int) -> tuple[int, ...]:
    """`resolve_mesh_shape(data, fsdp, tensor, sequence[, expert], num_devices)`: sizes in
    MESH_AXES order (trailing axes left out are 1), then the device count. Returns every
    axis's size: a single -1 filled with the remaining devices, the product checked."""
    *given, num_devices = sizes_then_devices
    if not 1 <= len(given) <= len(MESH_AXES):
        raise TypeError(f"resolve_mesh_shape takes 1 to {len(MESH_AXES)} sizes ({', '.join(MESH_AXES)}) "
                        f"and the device count; got {len(given)} sizes")
    sizes = list(given) + [1] * (len(MESH_AXES) - len(given))
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))}: at most one axis may be -1")
    for name, size in zip(MESH_AXES, sizes):
        if size == 0 or size < -1:
            raise ValueError(f"mesh axis {name}={size}: sizes must be positive (or -1 for 'the rest')")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if num_devices % known:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))}: {num_devices} devices are not divisible by {known}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices but {num_devices} are available"
        )
    return tuple(sizes)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, sequence: int = 1, expert: int = 1,
              devices=None) -> Mesh:
    """A mesh with MESH_AXES over all devices (all hosts), laid out for the topology."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(data, fsdp, tensor, sequence, expert, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _mesh_axes_for(name: str, rules) -> tuple[str, ...]:
    for logical, mesh_axes in rules:
        if logical == name:
            if mesh_axes is None:
                return ()
            return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    raise KeyError(f"no sharding rule for logical axis {name!r}")


def logical_to_spec(shape, axes, mesh: Mesh, rules=LOGICAL_RULES) -> PartitionSpec:
    """PartitionSpec for an array of `shape` with logical `axes`; indivisible dims stay replicated."""
    used: set[str] = set()
    spec = []
    for dim, name in zip(shape, axes):
        mesh_axes = tuple(a for a in _mesh_axes_for(name, rules)
                          if a not in used and dict(mesh.shape).get(a, 1) > 1)
        size = math.prod(mesh.shape[a] for a in mesh_axes)
        if not mesh_axes or dim % size:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def tree_shardings(shapes, axes, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedShardings for a pytree of arrays/ShapeDtypeStructs given a matching pytree of axis tuples."""
    return jax.tree.map(
        lambda x, a: NamedSharding(mesh, logical_to_spec(x.shape, a, mesh, rules)),
        shapes, axes, is_leaf=lambda a: isinstance(a, tuple) and all(isinstance(n, str) for n in a),
    )




def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading (batch) dimension over (data, fsdp, expert); the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules=LOGICAL_RULES):
    """Context in which the model's `nn.with_logical_constraint` calls take effect."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def describe_layout(tree) -> dict[str, str]:
    """'path': 'PartitionSpec' for every array leaf (to check that params are laid out as the rules say)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): str(leaf.sharding.spec) for path, leaf in flat if hasattr(leaf, "sharding")}


def batch_divisor(mesh: Mesh) -> int:
    """The devices a batch's rows are split over (data * fsdp * expert; an axis the mesh
    lacks counts 1)."""
    return int(np.prod([dict(mesh.shape).get(a, 1) for a in BATCH_AXES]))


def expert_shards(mesh) -> int:
    """The devices a mixture-of-experts layer's experts are split over (1 on a mesh without the axis)."""
    return int(dict(mesh.shape).get(EXPERT_AXIS, 1))


def sequence_shards(mesh) -> int:
    """The devices a row's positions are split over (1 on a mesh without the axis)."""
    return int(dict(mesh.shape).get(SEQUENCE_AXIS, 1))
