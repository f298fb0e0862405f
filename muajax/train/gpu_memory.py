"""The share of each GPU's memory jax may take (`run.gpu_memory_fraction`), applied by the
trainer before jax's GPU backend starts.

jax reads the share from the environment once, when it creates its GPU client (the first
device query): `XLA_CLIENT_MEM_FRACTION`, or the older name `XLA_PYTHON_CLIENT_MEM_FRACTION`
that jax 0.10 still reads (and refuses the two together: "Remove the latter one, it is
deprecated"). Without either, jax takes 75% of each card. So `python -m muajax.train` calls
`apply` after reading its config and before anything asks jax for a device:

- neither variable set: it sets `XLA_CLIENT_MEM_FRACTION` to the config's fraction;
- either one set: the environment wins, and the line says so.

The variable is set on every machine, not only where jax will use a GPU: only jax's GPU
client reads it, and knowing the platform would mean starting the backend first, too late
to set it. The line is printed only where jax runs on a GPU (`announce`, after the backend
started), where it is true.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import MutableMapping

VARIABLE = "XLA_CLIENT_MEM_FRACTION"
OLD_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # deprecated in jax, still read


@dataclasses.dataclass(frozen=True)
class MemoryFraction:
    variable: str         # the environment variable jax will read
    value: str            # its value
    from_environment: bool  # the user's: the config's fraction was not applied
    configured: float     # run.gpu_memory_fraction

    @property
    def line(self) -> str:
        share = f"{float(self.value):.0%}" if _is_number(self.value) else repr(self.value)
        if self.from_environment:
            return (f"muajax.train: GPU memory: {self.variable}={self.value} from the environment wins over "
                    f"run.gpu_memory_fraction={self.configured:g}: jax may take {share} of each GPU")
        return (f"muajax.train: GPU memory: set {self.variable}={self.value} (run.gpu_memory_fraction): "
                f"jax may take {share} of each GPU")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def decide(fraction: float, environ: MutableMapping[str, str]) -> MemoryFraction:
    """What jax will read: the user's variable if either name is set (non-empty: jax treats
    an empty one as unset), else the config's `fraction`."""
    for name in (VARIABLE, OLD_VARIABLE):
        if environ.get(name):
            return MemoryFraction(name, environ[name], True, fraction)
    return MemoryFraction(VARIABLE, f"{fraction:g}", False, fraction)


def apply(fraction: float, environ: MutableMapping[str, str] | None = None) -> MemoryFraction:
    """Set the variable jax reads (unless the user did); call before jax's first device query."""
    environ = os.environ if environ is None else environ
    setting = decide(fraction, environ)
    if not setting.from_environment:
        environ[setting.variable] = setting.value
    return setting


def announce(setting: MemoryFraction, platform: str) -> None:
    """Print the setting's line where jax runs on `platform` "gpu" (jax.default_backend())."""
    if platform == "gpu":
        print(setting.line, flush=True)
