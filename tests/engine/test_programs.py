"""The engine's device programs compiled ahead of time: no collective grows with the cache on 8
fake CPU devices, and the Pallas path compiles for a TPU topology with the real compiler."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from muajax.planning.topology import libtpu_available
from tests.support import workers

NEEDS_LIBTPU = pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                                  'pip install -e ".[tpu]"')

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_checks(script: str, *args: str) -> dict:
    """The worker `script` (tests/support/workers/) in a fresh process with 8 fake CPU devices; its last line, as JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, workers.path(script), *args],
                          check=False, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh", ["8,1,1", "1,8,1", "2,2,2", "1,2,4"])
def test_no_collective_grows_with_the_cache(mesh):
    """Decode and extend programs at a pool of 16K and 32K tokens and a gathered length of 256
    and 512 positions: their collectives (weights gathered from the FSDP layout, activations,
    loop flags) must be the very same list. Any access to the pool across devices would show
    up as a collective whose shape follows the pool or the gathered length."""
    found = run_checks("collective_checks.py", mesh)
    by_program = {}
    for key, ops in found.items():
        by_program.setdefault(key.split()[0], []).append(ops)
    assert sorted(by_program) == ["decode", "extend_16x32"]  # packed: rows of 16 tokens
    for program, variants in by_program.items():
        assert len(variants) == 3
        assert variants[0] == variants[1] == variants[2], (program, variants)
    if mesh == "1,8,1":  # the check sees collectives at all: FSDP weights are gathered
        assert any(op.startswith("all-gather") for op in by_program["decode"][0])


def test_sharded_pool_generates_what_one_device_does():
    """Five two-turn conversations on a shared prefix, in pools that preempt, on meshes whose
    data-parallel shards each own a share of the pages: the same tokens and logprobs as on one
    device."""
    found = run_checks("mesh_checks.py")
    want = found.pop("one device")
    assert want["stats"]["preemptions"] > 0 and want["stats"]["prefix_hits"] > 0
    for mesh, got in found.items():
        assert got["stats"]["prefix_hits"] > 0, mesh
        for (got_tokens, got_lp), (want_tokens, want_lp) in zip(got["generations"], want["generations"]):
            assert got_tokens == want_tokens, mesh
            np.testing.assert_allclose(got_lp, want_lp, atol=1e-5)
    assert sum(got["stats"]["preemptions"] for got in found.values()) > 0


@NEEDS_LIBTPU
def test_pallas_programs_compile_for_a_tpu_topology():
    """The real TPU compiler (libtpu, no TPU needed) compiles decode and extend with the kernel
    on v5p:2x2x1 (two page shards x tensor 2), also with token tiles; temporaries and collectives
    do not follow the pool."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # other processes on this host may hold libtpu
    proc = subprocess.run([sys.executable, workers.path("tpu_compile_checks.py"), "v5p:2x2x1"],
                          check=False, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(found) == ["decode pool=131072", "decode pool=65536", "decode tiled pool=65536",
                             "extend_64x64 pool=131072", "extend_64x64 pool=65536", "extend_64x64 tiled pool=65536"]
    for program in ("decode tiled", "extend_64x64 tiled"):  # token tiles: the kernel per tile
        assert found[f"{program} pool=65536"]["kernel"]
    for program in ("decode", "extend_64x64"):
        small, big = found[f"{program} pool=65536"], found[f"{program} pool=131072"]
        assert small["device_kind"].startswith("TPU v5") and small["kernel"] and big["kernel"]
        assert big["argument_bytes"] > small["argument_bytes"]  # the pool is an argument...
        assert big["temp_bytes"] == small["temp_bytes"]  # ...never copied
        assert big["collectives"] == small["collectives"]
