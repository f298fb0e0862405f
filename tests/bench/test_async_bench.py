"""`python -m muajax.bench async`: its name, its options and (slow tier) a
quick end-to-end run's JSON. No timing targets asserted: the figures depend on the box."""
import json
import os
import subprocess
import sys

import pytest

from muajax.bench import __main__ as bench_main
from muajax.bench import async_grpo
from muajax.bench.common import BenchError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_async_is_listed_and_dispatched_to_its_module():
    assert "async" in bench_main.available() and "async_grpo" not in bench_main.available()
    assert bench_main.main(["async", "--steps", "2", "--warmup", "2"]) == bench_main.EXIT_FAILED  # a BenchError


@pytest.mark.parametrize("argv, message", [(["--steps", "3", "--warmup", "2"], "--steps"),
                                           (["--jitter", "0.9"], "--jitter")])
def test_bad_options_are_bench_errors(argv, message):
    with pytest.raises(BenchError, match=message):
        async_grpo.parse(argv)


def test_quick_run_reports_both_runs_and_the_speedups():
    proc = subprocess.run([sys.executable, "-m", "muajax.bench", "async", "--quick"], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "async"
    sync, ahead = out["sync"], out["async"]
    assert out["async_speedup"] == pytest.approx(ahead["steps_per_hour"] / sync["steps_per_hour"])
    assert out["ideal_speedup"] == pytest.approx((sync["rollout_s"] + sync["update_s"])
                                                 / max(sync["rollout_s"], sync["update_s"]))
    assert out["staleness"]["sync"] == [0.0, 0.0] and out["staleness"]["async"][1] == 1.0
    assert "[sync]" in proc.stderr + proc.stdout and "ideal speed-up" in proc.stderr + proc.stdout
