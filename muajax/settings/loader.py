"""Config files: YAML with a `base:` chain, dotted command-line overrides, and dumps.

Building typed configs from the data is `muajax.settings.fields`.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from muajax.settings.fields import ConfigError, _short, config_to_dict
from muajax.settings.secrets import redact


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, which PyYAML would silently collapse."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        dup = next((k for i, k in enumerate(keys) if k in keys[:i] and k != "<<"), None)
        if dup is not None:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {dup!r}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _yaml_value(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`["a.b=3", "c=[1,2]", "d=null"]` → `{"a": {"b": 3}, "c": [1, 2], "d": None}` (YAML values; last wins)."""
    if isinstance(items, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got the string {items!r}")
    out: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {_short(item)} must look like 'key=value' (e.g. 'grpo.learning_rate=2e-6')")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        if not all(p and p == p.strip() for p in parts):
            raise ConfigError(f"override {_short(item)} has a malformed key {_short(key)}")
        try:
            value = _yaml_value(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {_short(item)}: the value is not valid YAML ({redact(str(e))})") from None
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {_short(item)} conflicts with an earlier override that set "
                                  f"'{'.'.join(parts[: i + 1])}' to {_short(child)}")
            node = child
        node[parts[-1]] = value
    return out


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `over` applied: mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _resolve_file_relative(data: dict[str, Any], path: str, keys: Sequence[str]) -> None:
    """Values of the dotted `keys` written "./x" or "../x" are made relative to the YAML file
    that holds them, so a config can name files shipped beside it from any working
    directory; other relative values keep meaning the working directory."""
    for key in keys:
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        value = node.get(leaf) if isinstance(node, dict) else None
        here = os.path.dirname(os.path.abspath(path))
        resolve = lambda v: (os.path.normpath(os.path.join(here, v))
                             if isinstance(v, str) and v.startswith(("./", "../")) else v)
        if isinstance(value, str):
            node[leaf] = resolve(value)
        elif isinstance(value, list):  # a list of paths (env.mcp.scenarios)
            node[leaf] = [resolve(v) for v in value]


def read_yaml(path: str | os.PathLike, chain: tuple[str, ...] = (),
              file_relative: Sequence[str] = ()) -> dict[str, Any]:
    """A YAML mapping with its `base:` chain (paths relative to the including file) merged under
    it; `file_relative` names dotted keys whose "./"-paths are resolved against their file."""
    path = os.fspath(path)
    real = os.path.realpath(path)
    if real in chain:
        loop = " -> ".join(os.path.basename(p) for p in (*chain, real))
        raise ConfigError(f"config 'base' chain loops: {loop}")
    try:
        with open(path, encoding="utf-8") as fh:
            data = _yaml_value(fh)
    except FileNotFoundError:
        via = f" (the base of {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {path}{via}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    _resolve_file_relative(data, path, file_relative)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: 'base' must be a relative path to another YAML file, got {_short(base)}")
    base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
    return deep_merge(read_yaml(base_path, (*chain, real), file_relative), data)


def dump_yaml(cfg: Any, path: str | os.PathLike | None = None) -> str:
    """The config as YAML text (loadable by `load_config`); also written to `path` if given."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None, width=100)
    if path is not None:
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    return text
