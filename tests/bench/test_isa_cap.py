"""`--cap-isa avx2`: XLA's own loops and its kernel library (YNNPACK) run as on a box
without AVX-512. XLA_FLAGS caps only the first; the library reads cpuinfo's flags."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muajax.bench import isa_cap

REPO = Path(__file__).resolve().parents[2]
needs_x86_linux = pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine != "x86_64" or "avx2" not in isa_cap.kernel_flags(),
    reason="the cap patches jaxlib's cpuinfo table on Linux x86-64 with AVX2")

CHECK = """
import numpy as np
from muajax.bench import isa_cap
capped = isa_cap.cap("avx2")
import jax, jax.numpy as jnp
a, b = np.random.RandomState(0).randn(8, 64).astype("f4"), np.random.RandomState(1).randn(64, 96).astype("f4")
np.testing.assert_allclose(np.asarray(jax.jit(jnp.dot)(a, b)), a @ b, rtol=1e-4, atol=1e-4)
print(sorted(capped["cleared"]), capped["xla_flags"])
try:
    isa_cap.cap("avx2")
except isa_cap.CapError as exc:
    print("refused:", exc)
"""


def run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, check=False)


@needs_x86_linux
def test_cap_clears_avx512_for_the_kernel_library_and_sets_xla_flag():
    proc = run(CHECK, XLA_FLAGS="")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cleared, flags = proc.stdout.strip().splitlines()[0].rsplit("] ", 1)
    assert ("'avx512f'" in cleared) == ("avx512f" in isa_cap.kernel_flags())
    assert flags == "--xla_cpu_max_isa=AVX2"
    # once JAX's backend has started, XLA_FLAGS is read: a late cap is refused, not silently partial
    assert "refused: cap the ISA before JAX starts" in proc.stdout


@needs_x86_linux
def test_cap_finds_its_symbols_in_jaxlib():
    import jaxlib._jax  # noqa: F401

    base, path = isa_cap._library()
    symbols = isa_cap.elf_symbols(path, isa_cap._SYMBOLS)
    assert symbols["cpuinfo_isa"][1] == len(isa_cap._FIELDS) and base > 0


def test_unknown_level_is_refused():
    with pytest.raises(isa_cap.CapError, match="unknown ISA level"):
        isa_cap.cap("sse2")


@needs_x86_linux
def test_a_script_runs_capped_in_another_interpreter(tmp_path):
    script = tmp_path / "side.py"
    script.write_text("import os, sys\nimport jax.numpy as jnp\nprint(float(jnp.ones(3).sum()), sys.argv[1:], "
                      "os.environ['XLA_FLAGS'])\n")
    proc = subprocess.run([sys.executable, str(REPO / "muajax/bench/isa_cap.py"), "avx2", str(script), "--x", "1"],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "3.0 ['--x', '1'] --xla_cpu_max_isa=AVX2"
