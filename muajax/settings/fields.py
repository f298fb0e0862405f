"""Typed frozen-dataclass configs from YAML-like data: the generic machinery every config
class uses, wherever it lives (it imports nothing else of muajax but `muajax.settings.secrets`).

`from_dict` builds nested frozen dataclasses with type checking and coercion; every error
is a `ConfigError` naming the dotted key at fault. Fields may carry numeric bounds
(`bounded`), and each dataclass may define `validate()` for cross-field checks, raising via
`check(cond, key, reason)` with a key relative to itself. A class that code also builds
directly (`RolloutConfig(max_turns=4)`) derives from `Checked`: construction then runs the
same checks, so each value has one set of rules wherever it comes from. A literal value
under a secret-looking key is refused, and so is a credential inside any value (a URL's
`user:key@`, a `?token=` query parameter, a list of command arguments with `--api-key X`):
configs are printed, logged and saved into checkpoints.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from muajax.settings.secrets import argument_credentials, redact, redact_arguments, value_credentials


class ConfigError(ValueError):
    """A config problem the user can fix; the message names the dotted key."""


class _FieldError(ConfigError):
    """Raised by `validate()` methods with a key relative to the dataclass; the walker
    that knows where the dataclass sits in the tree prefixes the full path."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"'{key}' {reason}")
        self.key, self.reason = key, reason


def check(cond: bool, key: str, reason: str) -> None:
    if not cond:
        raise _FieldError(key, reason)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _short(value: Any, limit: int = 80) -> str:
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = type(value)(redact_arguments(value))  # a command line: `--token=X`, `--api-key X`
    text = redact(repr(value))  # an error message must not echo a credential inside a value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _got(value: Any) -> str:
    return f"got {type(value).__name__} {_short(value)}"


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (tuple, list):
        return f"a list of {_type_name(args[0]) if args else 'any'}"
    if origin in (dict, Mapping):
        return f"a mapping of str to {_type_name(args[1]) if len(args) == 2 else 'any'}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _suggest(key: str, names: Sequence[str]) -> str | None:
    """The nearest field name: close spelling, initials ('lr' → 'learning_rate') or substring."""
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return close[0]
    low = key.lower()
    initials = [n for n in names if len(low) >= 2 and low == "".join(w[0] for w in n.split("_") if w)]
    parts = [n for n in names if len(low) >= 3 and (low in n or n in low)]
    return (initials + parts + [None])[0]


_SECRET_NAME = re.compile(
    r"(?:^|_)(?:api_?key|secret(?:_key)?|access_key|private_key|passw(?:or)?d|credentials?|token)$")
# Names that refer to a secret (`api_key_env`) or are tokenizer vocabulary (`pad_token`) are fine.
_NOT_SECRET = re.compile(r"_env$|_env_var$|_file$|_path$|"
                         r"^(?:pad|bos|eos|unk|sep|cls|mask|stop|end|start|special|im_start|im_end|tool)_token$")


def _looks_secret(name: str) -> bool:
    low = name.lower().replace("-", "_")
    return bool(_SECRET_NAME.search(low)) and not _NOT_SECRET.search(low)


def _check_secret(name: str, value: Any, path: str, sibling_names: Sequence[str] = ()) -> None:
    if value is None or value == "" or not _looks_secret(name):
        return
    env_field = f"{name}_env"
    hint = (f"set '{_join(path.rpartition('.')[0], env_field)}' to the variable's name"
            if env_field in sibling_names else "reference it by the variable's name")
    # The value itself is deliberately left out of the message: it is a secret.
    raise ConfigError(
        f"'{path}' holds a literal secret; configs are printed, logged and saved into "
        f"checkpoints, so they must not contain secrets. Put the secret in an environment "
        f"variable and {hint} (e.g. 'user.api_key_env: OPENAI_API_KEY')."
    )


def _refuse_credentials(path: str, found: list[str]) -> None:
    """A value holding a credential (a URL's userinfo or secret query parameter, a secret
    command-line flag's value) is refused like a secret under a secret key, without echoing it."""
    if found:
        raise ConfigError(
            f"'{path}' holds a credential ({'; '.join(found)}); configs are printed, logged and saved into "
            "checkpoints, so they must not contain secrets. Keep it in an environment variable instead (the "
            "simulated user's key: 'user.api_key_env'; an MCP server's: its 'env_vars' or scenario 'env').")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build the frozen dataclass `cls` from a (YAML-like) mapping, recursively.

    Values are type-checked and coerced; unknown keys, bad values and failed
    `validate()` checks raise `ConfigError` naming the dotted key (prefixed by `path`).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if isinstance(data, cls):
        validate_config(data, path)
        return data
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        where = f"'{path}'" if path else "the config root"
        raise ConfigError(f"{where} must be a mapping of {cls.__name__} fields, {_got(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    names = list(fields)
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"'{_join(path, str(key))}': keys must be strings, got {type(key).__name__}")
        _check_secret(key, value, _join(path, key), names)
        if key not in fields:
            guess = _suggest(key, names) or _find_nested(cls, key)
            hint = f" (did you mean '{_join(path, guess)}'?)" if guess else f" (known keys: {', '.join(names)})"
            raise ConfigError(f"unknown key '{_join(path, key)}'{hint}")
    hints = _hints(cls)
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], _join(path, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key '{_join(path, name)}'")
    try:
        obj = cls(**kwargs)
    except _FieldError as e:  # a `Checked` class validates as it is built
        raise ConfigError(f"'{_join(path, e.key)}' {e.reason}") from None
    if not isinstance(obj, Checked):
        _run_validate(obj, path)
    return obj


def _find_nested(cls: type, key: str, depth: int = 2) -> str | None:
    """Where a field called `key` lives in a sub-section (`learning_rate` → `grpo.learning_rate`)."""
    for name, tp in _hints(cls).items():
        for sub in (a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)):
            if key in _hints(sub):
                return f"{name}.{key}"
            deeper = _find_nested(sub, key, depth - 1) if depth > 1 else None
            if deeper:
                return f"{name}.{deeper}"
    return None


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1 or value is None:
            return _coerce(value, members[0], path)
        for member in members:  # first member that accepts the value wins
            try:
                return _coerce(value, member, path)
            except ConfigError:
                continue
        raise ConfigError(f"'{path}' must be {_type_name(tp)}, {_got(value)}")
    if value is None:
        raise ConfigError(f"'{path}' must not be null (expected {_type_name(tp)})")
    if origin is Literal:
        # `1 == True` in Python, so compare types too.
        if any(value == c and type(value) is type(c) for c in args):
            return value
        choices = ", ".join(repr(c) for c in args)
        close = difflib.get_close_matches(str(value), [str(c) for c in args], n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"'{path}' must be one of {choices}; got {_short(value)}{hint}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"'{path}' must be a bool (true/false), {_got(value)}")
    if tp in (int, float):
        return _to_number(value, tp, path)
    if tp is str:
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            _refuse_credentials(path, value_credentials(str(value)))
            return str(value)
        raise ConfigError(f"'{path}' must be a string, {_got(value)} (quote it in YAML)")
    if origin in (tuple, list) or tp in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"'{path}' must be {_type_name(tp)}, {_got(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"'{path}' must have exactly {len(args)} items, got {len(value)}: {_short(value)}")
            items = [_coerce(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, args))]
        else:
            elem = args[0] if args else Any
            items = [_coerce(v, elem, f"{path}[{i}]") for i, v in enumerate(value)]
        for index, where in argument_credentials([v if isinstance(v, str) else "" for v in items]):
            _refuse_credentials(f"{path}[{index}]", [where])
        return items if (origin or tp) is list else tuple(items)
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{path}' must be {_type_name(tp)}, {_got(value)}")
        val_tp = args[1] if len(args) == 2 else Any
        # a mapping under a `*_env` key maps names to variable NAMES (`headers_env`), never secrets
        holds_names = bool(_NOT_SECRET.search(path.rpartition(".")[2].lower()))
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"'{path}': keys must be strings, got {type(k).__name__} {_short(k)}")
            if not holds_names:
                _check_secret(k, v, _join(path, k))
            out[k] = _coerce(v, val_tp, _join(path, k))
        return out
    raise TypeError(f"config field '{path}' has an unsupported type {tp!r}")


def _to_number(value: Any, tp: type, path: str) -> int | float:
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads `1e-6` and `1e3` as strings: its float pattern needs a dot.
        try:
            number = float(value.replace("_", ""))
        except ValueError:
            pass
    if tp is float and number is not None:
        return float(number)
    if tp is int and number is not None and float(number).is_integer():
        return int(number)
    raise ConfigError(f"'{path}' must be {'an int' if tp is int else 'a float'}, {_got(value)}")


def bounded(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None) -> Any:
    """A field with numeric bounds, checked on validation (None values and nulls pass);
    for a tuple field, every item is checked."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return dataclasses.field(default=default, metadata={"bounds": bounds})


_BOUND_TESTS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"),
                "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def _check_bounds(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        bounds, value = f.metadata.get("bounds"), getattr(obj, f.name)
        if not bounds or value is None:
            continue
        items = [(f"{f.name}[{i}]", x) for i, x in enumerate(value)] if isinstance(value, tuple) else [(f.name, value)]
        for key, x in items:
            for kind, bound in bounds.items():
                test, sign = _BOUND_TESTS[kind]
                check(test(x, bound), key, f"must be {sign} {bound}, got {x}")


_SCALARS = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}


def _scalar_kinds(hint: Any) -> tuple | None:
    """The Python types a scalar (or optional scalar) field accepts; None for anything else."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        hint = next(a for a in args if a is not type(None))
    return _SCALARS.get(hint)


def _check_scalar_types(obj: Any) -> None:
    """Scalar fields hold their declared type (a bool is not an int here, as in JSON)."""
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), _hints(type(obj))[f.name]
        kinds = _scalar_kinds(hint)
        if kinds is None or value is None:
            continue
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            check(False, f.name, f"must be {_type_name(hint)}, {_got(value)}")


class Checked:
    """Base of config dataclasses that code also builds directly: `__post_init__` runs the
    field bounds, scalar types and `validate()`, raising `ConfigError` naming the field.
    (`from_dict` prefixes the section's path; it does not check twice.)"""

    def __post_init__(self) -> None:
        _check_scalar_types(self)
        _check_bounds(self)
        getattr(self, "validate", lambda: None)()


def _run_validate(obj: Any, path: str) -> None:
    try:
        _check_bounds(obj)
        getattr(obj, "validate", lambda: None)()
    except _FieldError as e:
        raise ConfigError(f"'{_join(path, e.key)}' {e.reason}") from None


def validate_config(cfg: Any, path: str = "") -> None:
    """Run every `validate()` in the tree, children first (e.g. after `dataclasses.replace`)."""
    if not dataclasses.is_dataclass(cfg):
        return
    for f in dataclasses.fields(cfg):
        value, sub = getattr(cfg, f.name), _join(path, f.name)
        children = ([(_join(sub, k), v) for k, v in value.items()] if isinstance(value, Mapping) else
                    [(f"{sub}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, (tuple, list)) else
                    [(sub, value)])
        for child_path, child in children:
            validate_config(child, child_path)
    if not isinstance(cfg, Checked):  # valid by construction
        _run_validate(cfg, path)


def config_to_dict(cfg: Any) -> Any:
    """Plain dicts/lists/scalars (YAML- and JSON-ready)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (tuple, list)):
        return [config_to_dict(v) for v in cfg]
    return cfg
