"""Hugging Face Qwen3 and Qwen3-MoE checkpoints <-> muajax params, through one table of name
rules (`muajax.models.hf_names`; the config in `muajax.models.hf_config`).

Loading is lazy and sharded: each parameter is built with `jax.make_array_from_callback`,
whose callback reads from memory-mapped safetensors only the slice (layers, experts, rows,
heads) that one device holds. A 32B checkpoint therefore never sits whole in one host's
memory. Export walks the same table backwards and writes sharded safetensors plus
config.json that `transformers` loads, one tensor at a time (nor does it sit whole in
memory on the way out). A mixture of experts is read in either of HF's layouts (per expert
or fused) and written per expert, as the Hub's Qwen3-MoE checkpoints are.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from muajax.models.hf_config import config_from_hf, config_to_hf, load_config
from muajax.models.hf_names import FUSED_MARKER, IGNORED, NAME_RULES, NameRule, active_rules, hf_names
from muajax.models.host_blocks import host_array, host_block
from muajax.models.qwen3 import Qwen3Config, abstract_params
from muajax.models.safetensors_io import CheckpointError, SafetensorsFile, SafetensorsWriter

__all__ = ["NAME_RULES", "CheckpointError", "NameRule", "SafetensorsFile", "SafetensorsWriter", "active_rules",
           "config_from_hf", "config_to_hf", "hf_names", "load_config", "load_params", "plan_hf_shards", "save_hf"]


# ----------------------------------------------------------------------------- loading


class _TensorIndex:
    """Which file holds which tensor: `model.safetensors.index.json`, or one file."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        index_path = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index_path}: corrupt index ({exc!r})") from None
        elif os.path.isfile(single):
            weight_map = {name: "model.safetensors" for name in SafetensorsFile(single).keys()}
        else:
            raise CheckpointError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
        self.weight_map: dict[str, str] = weight_map
        self._files: dict[str, SafetensorsFile] = {}
        for filename in sorted(set(weight_map.values())):  # open all now: a missing shard fails up front
            self._files[filename] = SafetensorsFile(os.path.join(hf_dir, filename))
        for name, filename in weight_map.items():
            if name not in self._files[filename]:
                raise CheckpointError(f"{os.path.join(hf_dir, filename)}: tensor {name!r} listed in the index is missing")

    def file_of(self, name: str) -> SafetensorsFile:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.hf_dir}: tensor {name!r} is missing from the checkpoint")
        return self._files[self.weight_map[name]]


def _check_tensors(index: _TensorIndex, cfg: Qwen3Config, rules, expected: dict[tuple[str, ...], tuple[int, ...]]):
    known = set()
    for rule in rules:
        want = expected[rule.param_path]
        per_tensor = want[rule.stacked:]
        fits: dict[tuple, bool] = {}  # by stored shape: a rule's thousands of expert tensors share one
        for name in hf_names(rule, cfg):
            known.add(name)
            f = index.file_of(name)
            shape = tuple(f.shape(name))
            if shape not in fits:
                try:  # shape-only: the transform is traced, nothing is read or allocated
                    got = jax.eval_shape(lambda w, rule=rule: rule.to_params(w, cfg),
                                         jax.ShapeDtypeStruct(shape, jnp.float32)).shape
                except (TypeError, ValueError):
                    got = None
                fits[shape] = got is not None and tuple(got) == tuple(per_tensor)
            if not fits[shape]:
                raise CheckpointError(
                    f"{f.path}: tensor {name!r} has shape {f.shape(name)}, which does not fit the config "
                    f"(expected the HF layout of {per_tensor})"
                )
    if cfg.tie_word_embeddings:
        known.add("lm_head.weight")  # tied checkpoints may still carry it; HF ignores it too
    unexpected = [n for n in index.weight_map if n not in known and not IGNORED.fullmatch(n)]
    if unexpected:
        path = os.path.join(index.hf_dir, index.weight_map[unexpected[0]])
        raise CheckpointError(f"{path}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all): not Qwen3")


def _path_get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _path_set(tree: dict, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_params(hf_dir: str, cfg: Qwen3Config | None = None, shardings=None):
    """Load a HF Qwen3 or Qwen3-MoE checkpoint directory into (params, cfg).

    `shardings`: a pytree like params of `jax.sharding.Sharding` (e.g. from
    `muajax.models.sharding.param_shardings`); None puts everything on the default device.
    Parameters are cast to `cfg.param_dtype`.
    """
    cfg = cfg or load_config(hf_dir)
    index = _TensorIndex(hf_dir)
    rules = active_rules(cfg, fused=cfg.is_moe and FUSED_MARKER in index.weight_map)
    boxed = abstract_params(cfg)
    abstract = jax.tree.map(lambda p: p.value if hasattr(p, "value") else p, boxed,
                            is_leaf=lambda p: hasattr(p, "names"))
    expected = {rule.param_path: tuple(_path_get(abstract, rule.param_path).shape) for rule in rules}
    _check_tensors(index, cfg, rules, expected)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict = {}
    for rule in rules:
        sharding = _path_get(shardings, rule.param_path) if shardings is not None else default
        read = lambda index_slices, rule=rule: _read_slice(index, rule, cfg, index_slices)
        _path_set(params, rule.param_path, jax.make_array_from_callback(expected[rule.param_path], sharding, read))
    return params, cfg


def _read_slice(index: _TensorIndex, rule: NameRule, cfg: Qwen3Config, index_slices) -> np.ndarray:
    """The param's block at `index_slices` (one device's), read from the tensors it spans
    (one per layer, or per layer and expert, in the block) in `cfg.param_dtype`."""
    lead = rule.stacked
    if not lead:
        name = rule.name()
        return np.ascontiguousarray(rule.to_params(index.file_of(name).get(name), cfg)[index_slices]).astype(
            cfg.weight_dtype)
    grid = [range(n)[s] for n, s in zip(rule.grid(cfg), index_slices[:lead])]
    parts = []
    for ix in itertools.product(*grid):
        name = rule.name(*ix)
        parts.append(np.asarray(rule.to_params(index.file_of(name).get(name), cfg)[index_slices[lead:]],
                                cfg.weight_dtype))
    return np.stack(parts).reshape(tuple(map(len, grid)) + parts[0].shape)


# ----------------------------------------------------------------------------- export


def _hf_tensors(params, cfg: Qwen3Config):
    """[(hf name, rule, param leaf, its index in the leaf's stacked dims: () for the whole)]
    in the export's order."""
    out = []
    for rule in active_rules(cfg):
        leaf = _path_get(params, rule.param_path)
        grid = itertools.product(*map(range, rule.grid(cfg)))
        out += [(name, rule, leaf, ix) for name, ix in zip(hf_names(rule, cfg), grid)]
    return out


def _host_part(leaf, ix: tuple[int, ...]) -> np.ndarray:
    """leaf[ix] (ix indexes its leading dims) on the host."""
    if not ix:
        return host_array(leaf)
    shape = tuple(leaf.shape)
    rest = shape[len(ix):]
    return host_block(leaf, ix + (0,) * len(rest), (1,) * len(ix) + rest).reshape(rest)


def _hf_shape(rule: NameRule, leaf, cfg: Qwen3Config) -> tuple[int, ...]:
    shape = tuple(leaf.shape[rule.stacked:])
    return tuple(jax.eval_shape(lambda w: rule.to_hf(w, cfg), jax.ShapeDtypeStruct(shape, jnp.float32)).shape)


def plan_hf_shards(tensors, np_dtype, cfg: Qwen3Config, max_shard_bytes: int) -> list[list[tuple]]:
    """The files' tensors, [(name, shape)] per file, from shapes alone: a file is closed when
    the next tensor would take it past `max_shard_bytes` (a tensor larger than that gets a
    file of its own)."""
    shards: list[list[tuple]] = [[]]
    shard_bytes = 0
    for name, rule, leaf, layer in tensors:
        shape = _hf_shape(rule, leaf, cfg)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
        if shard_bytes and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += nbytes
    return shards


def save_hf(params, cfg: Qwen3Config, out_dir: str, *, dtype: str | None = None,
            max_shard_bytes: int = 2 * 1024**3) -> list[str]:
    """Write params as a HF directory: config.json + sharded safetensors + index. Returns file names.

    Streamed: one tensor (one layer of one parameter) is read to the host
    (`muajax.models.host_blocks`), converted, cast and handed to the file's writer before
    the next is read, so a host holds one tensor, never the model. `dtype`: the files'
    (default: the params' own, e.g. bfloat16 params stay bfloat16). Every process must call
    this (a leaf split across processes is read collectively); only process 0 writes.
    """
    default = jax.tree.leaves(params)[0].dtype if jax.tree.leaves(params) else cfg.param_dtype
    np_dtype = np.dtype(jnp.dtype(dtype or default))
    torch_dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[str(np_dtype)]
    write = jax.process_index() == 0
    if write:
        os.makedirs(out_dir, exist_ok=True)
    tensors = _hf_tensors(params, cfg)
    shards = plan_hf_shards(tensors, np_dtype, cfg, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        files = ["model.safetensors"]
    source = iter(tensors)
    for filename, shard in zip(files, shards):
        path = os.path.join(out_dir, filename)
        with contextlib.ExitStack() as stack:
            writer = stack.enter_context(SafetensorsWriter(path, [(n, np_dtype, s) for n, s in shard],
                                                           metadata={"format": "pt"})) if write else None
            for _ in shard:
                name, rule, leaf, layer = next(source)
                value = _host_part(leaf, layer)
                tensor = np.ascontiguousarray(rule.to_hf(value, cfg).astype(np_dtype))
                del value
                if writer is not None:
                    writer.write(name, tensor)
                del tensor
    if not write:
        return []
    if len(shards) > 1:
        weight_map = {name: filename for filename, shard in zip(files, shards) for name, _ in shard}
        total = sum(int(np.prod(s, dtype=np.int64)) * np_dtype.itemsize for shard in shards for _, s in shard)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg, torch_dtype), f, indent=2)
    return files
