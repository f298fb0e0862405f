"""Scripts the tests run in fresh processes: by path (`python tests/support/workers/NAME.py`,
with the repository on PYTHONPATH) or as modules (`python -m tests.support.workers.NAME`).
A worker prints what it measured (JSON); the test that starts it asserts on it.

- collective_checks, mesh_checks, tpu_compile_checks: the engine's programs on 8 fake CPU
  devices and for a TPU topology (tests/engine/test_programs.py);
- context_parallel_checks, splash_checks: attention on meshes (tests/models/test_context_parallel.py,
  tests/models/test_attention.py);
- step_checks: the train steps on 8 fake CPU devices (tests/rl/test_step.py and test_sft.py,
  through tests/support/step_scenarios.py);
- compile_cache, jitter, multihost: runs in several processes (tests/train/test_compilation.py,
  test_determinism.py, test_multihost.py);
- sharded_export: the params fingerprint and HF export of sharded params, on 8 fake CPU devices or
  two processes (tests/models/test_host_blocks.py);
- moe_sharded_load: a Qwen3-MoE HF checkpoint loaded onto a mesh of 8 fake CPU devices
  (tests/models/test_moe_hf.py);
- mcp_demo_server: an MCP stdio server (tests/domains/mcp/).
"""
import os

DIR = os.path.dirname(os.path.abspath(__file__))


def path(name: str) -> str:
    """The file of the worker `name` (e.g. "mesh_checks.py")."""
    return os.path.join(DIR, name)
