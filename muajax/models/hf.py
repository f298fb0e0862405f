"""Hugging Face Qwen3 checkpoints <-> muajax params, through one table of name rules.

Loading is lazy and sharded: each parameter is built with `jax.make_array_from_callback`,
whose callback reads from memory-mapped safetensors only the slice (layers, rows,
heads) that one device holds. A 32B checkpoint therefore never sits whole in one host's
memory. Export walks the same table backwards and writes sharded safetensors plus
config.json that `transformers` loads, one tensor at a time (nor does it sit whole in
memory on the way out).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from muajax.models.qwen3 import Qwen3Config, abstract_params
from muajax.models.host_blocks import host_array, host_index
from muajax.models.safetensors_io import CheckpointError, SafetensorsFile, SafetensorsWriter

Array = np.ndarray


def _identity(w: Array, cfg: Qwen3Config) -> Array:
    return w


def _transpose(w: Array, cfg: Qwen3Config) -> Array:
    return w.T


def _heads_in(num_heads: Callable[[Qwen3Config], int]):
    """HF [heads*head_dim, hidden] -> muajax [hidden, heads, head_dim], and back."""

    def to_params(w, cfg):
        return w.reshape(num_heads(cfg), cfg.head_dim, w.shape[-1]).transpose(2, 0, 1)

    def to_hf(w, cfg):
        return w.transpose(1, 2, 0).reshape(-1, w.shape[0])

    return to_params, to_hf


def _o_to_params(w, cfg):  # HF [hidden, heads*head_dim] -> [heads, head_dim, hidden]
    return w.reshape(w.shape[0], cfg.num_heads, cfg.head_dim).transpose(1, 2, 0)


def _o_to_hf(w, cfg):
    return w.transpose(2, 0, 1).reshape(w.shape[2], -1)


@dataclasses.dataclass(frozen=True)
class NameRule:
    hf_name: str  # "{layer}" stands for the layer index
    param_path: tuple[str, ...]
    to_params: Callable[[Array, Qwen3Config], Array] = _identity
    to_hf: Callable[[Array, Qwen3Config], Array] = _identity

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf_name


_q_in, _q_out = _heads_in(lambda c: c.num_heads)
_kv_in, _kv_out = _heads_in(lambda c: c.num_kv_heads)
_LAYER = "model.layers.{layer}."
NAME_RULES: tuple[NameRule, ...] = (
    NameRule("model.embed_tokens.weight", ("embed",)),
    NameRule("model.norm.weight", ("final_norm",)),
    NameRule("lm_head.weight", ("lm_head",), _transpose, _transpose),
    NameRule(_LAYER + "input_layernorm.weight", ("layers", "attn_norm")),
    NameRule(_LAYER + "self_attn.q_proj.weight", ("layers", "wq"), _q_in, _q_out),
    NameRule(_LAYER + "self_attn.k_proj.weight", ("layers", "wk"), _kv_in, _kv_out),
    NameRule(_LAYER + "self_attn.v_proj.weight", ("layers", "wv"), _kv_in, _kv_out),
    NameRule(_LAYER + "self_attn.o_proj.weight", ("layers", "wo"), _o_to_params, _o_to_hf),
    NameRule(_LAYER + "self_attn.q_norm.weight", ("layers", "q_norm")),
    NameRule(_LAYER + "self_attn.k_norm.weight", ("layers", "k_norm")),
    NameRule(_LAYER + "post_attention_layernorm.weight", ("layers", "mlp_norm")),
    NameRule(_LAYER + "mlp.gate_proj.weight", ("layers", "w_gate"), _transpose, _transpose),
    NameRule(_LAYER + "mlp.up_proj.weight", ("layers", "w_up"), _transpose, _transpose),
    NameRule(_LAYER + "mlp.down_proj.weight", ("layers", "w_down"), _transpose, _transpose),
)
# Buffers some exporters include; they carry no weights.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def hf_names(rule: NameRule, cfg: Qwen3Config) -> list[str]:
    if rule.per_layer:
        return [rule.hf_name.format(layer=i) for i in range(cfg.num_layers)]
    return [rule.hf_name]


def active_rules(cfg: Qwen3Config) -> list[NameRule]:
    return [r for r in NAME_RULES if not (cfg.tie_word_embeddings and r.param_path == ("lm_head",))]


# ----------------------------------------------------------------------------- config


def config_from_hf(hf_config: dict, *, source: str = "config.json", **overrides) -> Qwen3Config:
    """Accepts both config formats: hub checkpoints' top-level `rope_theta` and the
    `rope_parameters` dict that transformers 5 writes."""
    model_type = hf_config.get("model_type")
    archs = hf_config.get("architectures") or []
    if model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
        raise CheckpointError(
            f"{source}: not a Qwen3 checkpoint (model_type={model_type!r}, architectures={archs}); "
            "muajax loads dense Qwen3 (Qwen3ForCausalLM) only"
        )
    rope = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{source}: no rope_theta (neither top-level nor in rope_parameters)")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={hf_config['hidden_act']!r} is not Qwen3's 'silu'")
    if hf_config.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias=true is not Qwen3's architecture")
    if hf_config.get("use_sliding_window"):
        raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
    try:
        heads = int(hf_config["num_attention_heads"])
        hidden = int(hf_config["hidden_size"])
        values = dict(
            vocab_size=int(hf_config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf_config["intermediate_size"]),
            num_layers=int(hf_config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf_config.get("num_key_value_heads") or heads),
            head_dim=int(hf_config.get("head_dim") or hidden // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 40960)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing required key {exc.args[0]!r}") from None
    values.update(overrides)
    return Qwen3Config(**values)


def config_to_hf(cfg: Qwen3Config, torch_dtype: str) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        # Qwen3's special ids only make sense when the vocabulary holds them (not in tiny test models).
        "bos_token_id": 151643 if cfg.vocab_size > 151643 else None,
        "eos_token_id": 151645 if cfg.vocab_size > 151645 else None,
        "dtype": torch_dtype,
        "torch_dtype": torch_dtype,
    }


def load_config(hf_dir: str, **overrides) -> Qwen3Config:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: not found (is {hf_dir!r} a Hugging Face model directory?)")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    return config_from_hf(data, source=path, **overrides)


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


def _check_tensors(index: _TensorIndex, cfg: Qwen3Config, expected: dict[tuple[str, ...], tuple[int, ...]]):
    known = set()
    for rule in active_rules(cfg):
        want = expected[rule.param_path]
        per_tensor = want[1:] if rule.per_layer else want
        for name in hf_names(rule, cfg):
            known.add(name)
            f = index.file_of(name)
            stored = jax.ShapeDtypeStruct(f.shape(name), jnp.float32)
            try:  # shape-only: the transform is traced, nothing is read or allocated
                got = jax.eval_shape(lambda w, rule=rule: rule.to_params(w, cfg), stored).shape
            except (TypeError, ValueError):
                got = None
            if tuple(got) != tuple(per_tensor):
                raise CheckpointError(
                    f"{f.path}: tensor {name!r} has shape {f.shape(name)}, which does not fit the config "
                    f"(expected the HF layout of {per_tensor})"
                )
    if cfg.tie_word_embeddings:
        known.add("lm_head.weight")  # tied checkpoints may still carry it; HF ignores it too
    unexpected = [n for n in index.weight_map if n not in known and not _IGNORED.fullmatch(n)]
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
    """Load a HF Qwen3 checkpoint directory into (params, cfg).

    `shardings`: a pytree like params of `jax.sharding.Sharding` (e.g. from
    `muajax.models.sharding.param_shardings`); None puts everything on the default device.
    Parameters are cast to `cfg.param_dtype`.
    """
    cfg = cfg or load_config(hf_dir)
    index = _TensorIndex(hf_dir)
    boxed = abstract_params(cfg)
    abstract = jax.tree.map(lambda p: p.value if hasattr(p, "value") else p, boxed,
                            is_leaf=lambda p: hasattr(p, "names"))
    expected = {rule.param_path: tuple(_path_get(abstract, rule.param_path).shape) for rule in active_rules(cfg)}
    _check_tensors(index, cfg, expected)
    dtype = cfg.weight_dtype
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict = {}
    for rule in active_rules(cfg):
        shape = expected[rule.param_path]
        sharding = _path_get(shardings, rule.param_path) if shardings is not None else default
        names = hf_names(rule, cfg)

        def read(index_slices, rule=rule, names=names):
            if not rule.per_layer:
                src = index.file_of(names[0])
                return np.ascontiguousarray(rule.to_params(src.get(names[0]), cfg)[index_slices]).astype(dtype)
            layers = range(len(names))[index_slices[0]]
            parts = [rule.to_params(index.file_of(names[i]).get(names[i]), cfg)[index_slices[1:]] for i in layers]
            return np.stack(parts).astype(dtype)

        _path_set(params, rule.param_path, jax.make_array_from_callback(shape, sharding, read))
    return params, cfg


# ----------------------------------------------------------------------------- export


def _hf_tensors(params, cfg: Qwen3Config):
    """[(hf name, rule, param leaf, layer index or None)] in the export's order."""
    out = []
    for rule in active_rules(cfg):
        leaf = _path_get(params, rule.param_path)
        names = hf_names(rule, cfg)
        out += [(name, rule, leaf, i if rule.per_layer else None) for i, name in enumerate(names)]
    return out


def _hf_shape(rule: NameRule, leaf, per_layer: bool, cfg: Qwen3Config) -> tuple[int, ...]:
    shape = tuple(leaf.shape[1:] if per_layer else leaf.shape)
    return tuple(jax.eval_shape(lambda w: rule.to_hf(w, cfg), jax.ShapeDtypeStruct(shape, jnp.float32)).shape)


def plan_hf_shards(tensors, np_dtype, cfg: Qwen3Config, max_shard_bytes: int) -> list[list[tuple]]:
    """The files' tensors, [(name, shape)] per file, from shapes alone: a file is closed when
    the next tensor would take it past `max_shard_bytes` (a tensor larger than that gets a
    file of its own)."""
    shards: list[list[tuple]] = [[]]
    shard_bytes = 0
    for name, rule, leaf, layer in tensors:
        shape = _hf_shape(rule, leaf, layer is not None, cfg)
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
                value = host_index(leaf, layer) if layer is not None else host_array(leaf)
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
