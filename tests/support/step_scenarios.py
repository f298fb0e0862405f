"""Run tests/support/workers/step_checks.py in a fresh process with 8 fake CPU devices, once
per group per pytest session, and hand back its JSON measurements."""
import functools
import json
import os
import subprocess
import sys

from tests.support import workers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=None)
def checks(group: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # LLVM opt level 0 halves compile time; every compared run in the process shares it.
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, workers.path("step_checks.py"), group],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scenario(group: str, name: str) -> dict:
    out = checks(group)[name]
    assert "error" not in out, out.get("error")
    return out
