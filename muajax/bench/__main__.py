"""`python -m muajax.bench {forward,generate,multiturn,train,rollout,serve,...} [options]`."""
from __future__ import annotations

import importlib
import pkgutil
import sys

import muajax.bench as bench_pkg
from muajax.bench.common import BenchError, emit_json

# helpers: a script, the floor generate runs, the device check's checks
_NOT_BENCHMARKS = {"common", "__main__", "tunix_side", "decode_floor", "device_checks"}
ALIASES = {"async": "async_grpo"}  # benchmark name -> module, where the name is a Python keyword
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def available() -> list[str]:
    """Benchmark modules present in this install (planned ones first, then any others)."""
    modules = {m.name for m in pkgutil.iter_modules(bench_pkg.__path__)} - _NOT_BENCHMARKS
    names = {module: name for name, module in ALIASES.items()}
    found = {names.get(m, m) for m in modules}
    return [n for n in bench_pkg.PLANNED if n in found] + sorted(found - set(bench_pkg.PLANNED))


def usage() -> str:
    have = available()
    missing = [n for n in bench_pkg.PLANNED if n not in have]
    lines = ["usage: python -m muajax.bench <benchmark> [options]   (<benchmark> --help for its options)",
             "available: " + (", ".join(have) or "none")]
    if missing:
        lines.append("planned, not written yet: " + ", ".join(missing))
    return "\n".join(lines)


def _fail(name: str | None, msg: str, code: int) -> int:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    emit_json({"benchmark": name, "error": msg})
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return EXIT_OK if argv else EXIT_USAGE
    name, rest = argv[0], argv[1:]
    if name not in available():
        if name in bench_pkg.PLANNED:
            why = f"benchmark {name!r} is not available yet (muajax/bench/{name}.py has not been written)"
        else:
            why = f"unknown benchmark {name!r}; available: {', '.join(available()) or 'none'}"
        return _fail(name, why, EXIT_USAGE)
    module = importlib.import_module(f"muajax.bench.{ALIASES.get(name, name)}")
    run = getattr(module, "run", None)
    if not callable(run):
        return _fail(name, f"{module.__name__} has no run(argv) function", EXIT_USAGE)
    try:
        result = run(rest)
    except BenchError as exc:
        return _fail(name, str(exc), EXIT_FAILED)
    if not isinstance(result, dict):
        return _fail(name, f"muajax.bench.{name}.run returned {type(result).__name__}, expected dict", EXIT_FAILED)
    emit_json({"benchmark": name, **result})
    # a benchmark that checks something (`device`) says `passed`; False fails the command
    return EXIT_FAILED if result.get("passed") is False else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
