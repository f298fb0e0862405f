"""Benchmarks: `python -m muajax.bench <name> [options]`.

Each benchmark is a module `muajax.bench.<name>` with `run(argv: list[str]) -> dict`:
it parses its own options from `argv`, prints human-readable lines (each figure beside
the reference it is compared with, measured in the same process, and their ratio), and
returns the figures. The dispatcher (`__main__`) prints the returned dict as the one JSON
line that ends the output. A new benchmark needs only its module: the dispatcher finds it.
Timing helpers live in `muajax.bench.common`.
"""

PLANNED = ("forward", "generate", "multiturn", "train", "rollout", "serve")
