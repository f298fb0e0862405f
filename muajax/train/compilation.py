"""Compilation across restarts and inside steps: jax's persistent compilation cache
(`run.compilation_cache_dir`), and a clock of the time jax spends compiling.

With the cache, a resumed run reads its train steps, engine programs and evaluation back
from disk instead of compiling them again (at Qwen3-8B on a TPU slice each takes minutes).
The clock adds up jax's own monitoring events (tracing, lowering to MLIR, the backend
compile or its retrieval from the cache), so a step's metrics can show its compile time
apart from the time it ran.
"""
from __future__ import annotations

import os
import threading
import time

import jax
from jax.experimental.compilation_cache import compilation_cache

# jax's events (jax._src.dispatch) for each stage of turning a function into an executable
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def enable_compilation_cache(directory: str | None) -> None:
    """Keep every compiled program in `directory` (None: leave jax's setting alone). Programs
    are cached whatever their compile time, so small ones (the engine's buckets) come back too."""
    if directory is None:
        return
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.set_cache_dir(directory)
    compilation_cache.reset_cache()  # jax reads the directory once, at its first compile


class CompileClock:
    """Seconds jax spent compiling since the last `take()`, in any thread. Spans are merged
    before they are added: tracing a jitted function inside another one reports both."""

    _lock = threading.Lock()
    _spans: list[tuple[float, float]] = []
    _listening = False

    def __init__(self):
        with CompileClock._lock:
            if not CompileClock._listening:  # jax keeps listeners for the life of the process
                jax.monitoring.register_event_time_span_listener(CompileClock._record)
                CompileClock._listening = True
        self._since = time.time()

    @staticmethod
    def _record(event: str, start: float, end: float, **_) -> None:
        if event in COMPILE_EVENTS:
            with CompileClock._lock:
                CompileClock._spans.append((start, end))

    def take(self) -> float:
        """The compile seconds since the last take (or since this clock was made)."""
        now = time.time()
        with CompileClock._lock:
            spans = sorted((max(a, self._since), min(b, now)) for a, b in CompileClock._spans if b > self._since)
            # other clocks may still need recent spans; an hour back is more than any step
            CompileClock._spans[:] = [(a, b) for a, b in CompileClock._spans if b > now - 3600]
        self._since = now
        total, reach = 0.0, float("-inf")
        for start, end in spans:
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total
