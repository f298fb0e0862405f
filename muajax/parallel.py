"""Device mesh and the one rules table that maps logical axis names onto mesh axes.

The mesh always has three axes, (data, fsdp, tensor):
  data   — pure data parallelism (replicated weights);
  fsdp   — data parallelism with weights and optimizer state sharded (ZeRO-3 style);
  tensor — Megatron-style tensor parallelism over heads, MLP width and vocabulary.
Batches are split over (data, fsdp). A dimension that a mesh axis does not divide
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

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("vocab", "tensor"),
    # The embedding table is read by a gather: sharding its rows would make XLA replicate
    # it anyway (an "involuntary full rematerialization"), so only its width is sharded.
    ("embed_vocab", None),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
    ("cache_batch", BATCH_AXES),
    ("cache_length", None),
    ("cache_kv_heads", "tensor"),
)


def resolve_mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Fill a single -1 with the remaining devices and check the product."""
    sizes = [data, fsdp, tensor]
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


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over all devices (all hosts), laid out for the topology."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(data, fsdp, tensor, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


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
        mesh_axes = tuple(a for a in _mesh_axes_for(name, rules) if a not in used and mesh.shape[a] > 1)
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
    """Leading (batch) dimension over (data, fsdp); the rest replicated."""
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
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
