"""`run.compilation_cache_dir`: a second process (a resumed run) reads the train step back
from jax's persistent cache instead of compiling it, and its compile time shows that."""
import json
import os
import subprocess
import sys

from tests.support import workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_worker(cache_dir) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, workers.path("compile_cache.py"),
                           str(cache_dir)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_run_reads_its_train_step_from_the_cache(tmp_path):
    first = run_worker(tmp_path / "cache")
    assert os.listdir(tmp_path / "cache")  # the step was written
    second = run_worker(tmp_path / "cache")
    assert first["cache_hits"] == 0 and second["cache_hits"] >= 1, (first, second)
    assert first["compile_s"] > 0 and second["compile_s"] < 0.7 * first["compile_s"], (first, second)
