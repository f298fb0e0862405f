"""Where a plan compiles: a TPU slice you don't have, through libtpu's ahead-of-time
topologies, or fake CPU devices.

Names follow Cloud TPU's accelerator types, whose number counts different things per
generation (https://cloud.google.com/tpu/docs/v4, .../v5p, .../v5e, .../v6e):
  v4-N, v5p-N   N TensorCores, two per chip: v5p-64 is 32 chips (a 2x4x4 slice);
  v5e-N, v6e-N  N chips, one TensorCore each: v6e-16 is 16 chips (4x4).
`v5p:4x4x4` names the chips' physical shape directly (any shape libtpu accepts), and
`cpu:N` is N fake CPU devices compiled by XLA:CPU (`h100:N`, `a100:N`: the same, judged
against that GPU's memory: an estimate, since no GPU compiler runs here). A v4/v5p chip's two TensorCores run as
one jax device (megacore), so devices == chips on every TPU generation here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys

import jax
from jax._src import (
    xla_bridge,  # private, but jax is pinned (==0.10.2) and no public API says this
)
from jax.experimental import topologies

from muajax.chips import Chip, chip_for_device_kind, get_chip

TPU_EXTRA_HINT = 'pip install -e ".[tpu]"'
GPUS = ("h100", "a100")  # `h100:N`: XLA:CPU judged against that GPU
_REEXEC_MARK = "MUAJAX_PLAN_REEXEC"


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str
    cores_per_chip_in_name: int  # what the N of "v5p-N" counts per chip
    dims: int                    # 3D torus (v4, v5p) or 2D (v5e, v6e)
    chip_config: str             # libtpu's chip_config_name


GENERATIONS = {
    "v4": Generation("v4", 2, 3, "megacore"),
    "v5p": Generation("v5p", 2, 3, "megacore"),
    "v5e": Generation("v5e", 1, 2, "default"),
    "v6e": Generation("v6e", 1, 2, "default"),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}

# Slice shapes by chip count, from the Cloud TPU docs' configuration tables (v4 and v5p share
# theirs, as do v5e and v6e). Other sizes: name the shape, e.g. v5p:4x4x12.
_SHAPES = {
    3: {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8), 256: (4, 8, 8),
        512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16), 6144: (16, 16, 24)},
    2: {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)},
}


class LibtpuMissingError(RuntimeError):
    """A TPU topology was asked for but libtpu is not installed."""


@dataclasses.dataclass(frozen=True)
class TopologySpec:
    text: str                      # as the user wrote it
    platform: str                  # "tpu" or "cpu"
    chips: int
    generation: str | None = None  # "v5p", ...; None on cpu
    shape: tuple[int, ...] = ()    # physical chip grid; () on cpu
    gpu: str | None = None         # "h100:8": compiled by XLA:CPU, judged against an H100 (an estimate)

    @property
    def topology_name(self) -> str:
        """libtpu's name for the slice, e.g. "v5p:2x4x4"."""
        return f"{self.generation}:{'x'.join(map(str, self.shape))}"

    @property
    def chip(self) -> Chip | None:
        if self.gpu:
            return get_chip(self.gpu)
        return get_chip(self.generation) if self.generation else None

    def describe(self) -> str:
        if self.gpu:
            return f"{self.chips} x {self.gpu}, estimated on {self.chips} fake CPU devices (XLA:CPU)"
        if self.platform == "cpu":
            return f"{self.chips} fake CPU devices (XLA:CPU)"
        return f"{self.text} = {self.topology_name}, {self.chips} chips"


def _generation(name: str, text: str) -> Generation:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in GENERATIONS:
        raise ValueError(f"topology {text!r}: unknown TPU generation {name!r}; known: {', '.join(GENERATIONS)}")
    return GENERATIONS[key]


def parse_topology(text: str) -> TopologySpec:
    """`v5p-64`, `v6e-16`, `v5e-8`, `v4-32`, `v5p:4x4x4`, `cpu:8` or `h100:8` -> TopologySpec (no jax needed)."""
    raw = text.strip()
    if m := re.fullmatch(r"cpu:(\d+)", raw, re.IGNORECASE):
        if int(m.group(1)) < 1:
            raise ValueError(f"topology {text!r}: cpu:N needs N >= 1")
        return TopologySpec(raw, "cpu", int(m.group(1)))
    if m := re.fullmatch(rf"({'|'.join(GPUS)}):(\d+)", raw, re.IGNORECASE):
        # No GPU compiler runs here: XLA:CPU stands in, so the figures are an estimate.
        if int(m.group(2)) < 1:
            raise ValueError(f"topology {text!r}: {m.group(1)}:N needs N >= 1")
        return TopologySpec(raw, "cpu", int(m.group(2)), gpu=m.group(1).lower())
    if m := re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", raw, re.IGNORECASE):
        gen = _generation(m.group(1), text)
        shape = tuple(int(d) for d in m.group(2).split("x"))
        if len(shape) != gen.dims or min(shape) < 1:
            raise ValueError(f"topology {text!r}: {gen.name} slices are {gen.dims}-D, e.g. "
                             f"{gen.name}:{'x'.join(['2'] * gen.dims)}")
        return TopologySpec(raw, "tpu", math.prod(shape), gen.name, shape)
    if m := re.fullmatch(r"([a-z0-9]+)-(\d+)", raw, re.IGNORECASE):
        gen = _generation(m.group(1), text)
        count = int(m.group(2))
        chips, rest = divmod(count, gen.cores_per_chip_in_name)
        table = _SHAPES[gen.dims]
        if rest or chips not in table:
            unit = "TensorCores (2 per chip)" if gen.cores_per_chip_in_name == 2 else "chips"
            sizes = ", ".join(f"{gen.name}-{c * gen.cores_per_chip_in_name}" for c in table)
            raise ValueError(f"topology {text!r}: the number in {gen.name}-N counts {unit}; known sizes: {sizes}; "
                             f"or name the chip grid, e.g. {gen.name}:{'x'.join(map(str, table[max(table)]))}")
        return TopologySpec(raw, "tpu", chips, gen.name, table[chips])
    raise ValueError(f"cannot read a topology from {text!r}: expected e.g. v5p-64, v6e-16, v5p:4x4x4 or cpu:8")


def judged_hbm(chip: Chip | None, gpu_memory_fraction: float) -> tuple[int | None, str | None]:
    """(the memory per device a plan is judged against, a note when it is not the chip's own
    limit). A TPU: the compiler's limit (`usable_hbm_bytes`). A GPU: the share of the card
    the trainer lets jax take (`run.gpu_memory_fraction`, which `python -m muajax.train` sets
    as XLA_CLIENT_MEM_FRACTION), since jax's allocator never hands out more."""
    if chip is None or chip.name not in GPUS:
        return (chip.usable_hbm_bytes if chip else None), None
    hbm = int(gpu_memory_fraction * chip.hbm_bytes)
    return hbm, (f"judged against {gpu_memory_fraction:g} x {chip.name}'s {chip.hbm_bytes / 1e9:g} GB = "
                 f"{hbm / 1e9:.1f} GB ({hbm / 2**30:.2f} GiB) per GPU: the share of each GPU the trainer lets jax "
                 f"take (run.gpu_memory_fraction)")


def libtpu_available() -> bool:
    try:
        import libtpu  # noqa: F401  (only whether it imports: the package is a path to libtpu.so)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _quiet_libtpu_env(spec: TopologySpec):
    """Tell libtpu it is on a one-host machine with no TPU while it first loads, so it
    neither queries a metadata server nor prints warnings about the missing hardware.
    Compiling touches no device, so several planning processes may load libtpu at once
    (the lockfile exists to keep two processes off one real TPU). The variables are taken
    back afterwards: a process started later from this one (a trainer) would otherwise
    read TPU_WORKER_HOSTNAMES as a TPU pod to join."""
    count = spec.chips * GENERATIONS[spec.generation].cores_per_chip_in_name
    defaults = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_ID": "0",
                "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": f"{spec.generation}-{count}"}
    added = [key for key in defaults if key not in os.environ]
    os.environ.update({key: defaults[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def tpu_devices(spec: TopologySpec) -> list:
    """The slice's TPU devices, to build a Mesh on and compile for (nothing runs on them)."""
    if spec.platform != "tpu":
        raise ValueError(f"{spec.text} is not a TPU topology")
    if not libtpu_available():
        raise LibtpuMissingError(f"topology {spec.text} needs libtpu, the TPU compiler: {TPU_EXTRA_HINT}")
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")  # nothing runs: don't look for TPU hardware
    single_chip = spec.chips == 1
    with _quiet_libtpu_env(spec):  # the TPU plugin first loads in get_topology_desc
        desc = topologies.get_topology_desc(
            topology_name=spec.topology_name, platform="tpu", chip_config_name=GENERATIONS[spec.generation].chip_config,
            **({"chips_per_host_bounds": (1, 1, 1)} if single_chip else {}))
    devices = list(desc.devices)
    if len(devices) != spec.chips:
        raise RuntimeError(f"libtpu gave {len(devices)} devices for {spec.topology_name}, expected {spec.chips}")
    return devices


def ensure_cpu_devices(n: int, reexec_argv: list[str] | None = None, module: str = "muajax.plan") -> None:
    """Make the CPU backend expose n devices: set XLA_FLAGS before jax creates its backends
    or, when jax already runs with another count, re-execute `python -m module *reexec_argv` (only a
    command may: it replaces the process) — otherwise raise."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    want = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    if not xla_bridge.backends_are_initialized():  # importing jax creates no backend; a device query does
        os.environ["XLA_FLAGS"] = want
        jax.config.update("jax_platforms", "cpu")
        return
    if jax.default_backend() == "cpu" and len(jax.devices()) == n:
        return
    if os.environ.get(_REEXEC_MARK) or reexec_argv is None:
        raise RuntimeError(f"plan: needs {n} CPU devices but jax already started with {len(jax.devices())} "
                           f"{jax.default_backend()} device(s); run `python -m {module} ...` in a fresh process")
    env = dict(os.environ, XLA_FLAGS=want, JAX_PLATFORMS="cpu", **{_REEXEC_MARK: "1"})
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *reexec_argv], env)


def one_host_devices(devices: list) -> list:
    """One host's devices of a TPU slice as the devices of a slice of that host alone, numbered
    from 0, for a program that runs on that host's chips only (the rollout engine's). libtpu
    compiles for a subset of a slice only when its ids are 0..n-1: a v6e host's 4 chips of a
    4x4 are ids 0, 1, 4 and 5, and a program on them fails ("Unexpected device_id 5 [...]
    target has 4 device_id"). Devices already numbered 0..n-1, or not TPUs, come back as given."""
    if devices[0].platform != "tpu" or sorted(d.id for d in devices) == list(range(len(devices))):
        return devices
    chip = chip_for_device_kind(devices[0].device_kind)
    if chip is None or chip.name not in GENERATIONS:
        raise ValueError(f"no TPU generation for device kind {devices[0].device_kind!r}")
    dims = GENERATIONS[chip.name].dims
    shape = [max(d.coords[i] for d in devices) - min(d.coords[i] for d in devices) + 1 for i in range(dims)]
    if math.prod(shape) != len(devices):
        raise ValueError(f"{len(devices)} devices do not fill a {'x'.join(map(str, shape))} block of chips")
    return tpu_devices(parse_topology(f"{chip.name}:{'x'.join(map(str, shape))}"))


def devices_for(spec: TopologySpec, reexec_argv: list[str] | None = None) -> list:
    """Devices to plan on: the TPU slice's, or n CPU devices (re-executing if must and may)."""
    if spec.platform == "tpu":
        return tpu_devices(spec)
    ensure_cpu_devices(spec.chips, reexec_argv)
    return list(jax.devices("cpu"))[: spec.chips]
