"""Accelerator chips: memory, peak bf16 FLOP/s, HBM bandwidth and collective bandwidth.

Every row cites where its numbers come from. `usable_hbm_bytes` is what one program may
use: for TPUs it is the limit the TPU compiler itself enforces (libtpu 0.0.42 prints it in
its out-of-memory message: "exceeds available HBM (95.74G)", in GiB), a little under the
nominal capacity because the runtime reserves some. `fits` is judged against it.

`ring_bytes_per_s` is the rate at which one device receives data in a ring collective
over one mesh axis: on a TPU torus a device has a neighbour on each side, so it receives
over two links at once, one direction each = the bidirectional bandwidth of one link (the
scaling book's W_ici for a 1D ring with wraparound); on an NVLink/NVSwitch node, one
GPU's one-way NVLink bandwidth. A mesh axis laid over two torus dimensions gets more,
which the roofline ignores (a conservative estimate).
"""
from __future__ import annotations

import dataclasses

GiB = 2**30
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int              # nominal HBM per chip
    usable_hbm_bytes: int       # what one program may use (the compiler's limit where known)
    peak_flops: float           # dense bf16 FLOP/s per chip
    hbm_bytes_per_s: float      # HBM bandwidth per chip
    ring_bytes_per_s: float     # see the module docstring
    interconnect: str           # "ICI" or "NVLink"
    device_kinds: tuple[str, ...]  # jax `device.device_kind` values of this chip


CHIPS: dict[str, Chip] = {
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s.
    # ICI: jax-ml/scaling-book tpus.md, "TPU v4p: 4.5e10 one-way, 9e10 bidi" bytes/s per link.
    # Usable: libtpu 0.0.42 on v4:2x2x1 (megacore), "available HBM (30.75G)".
    "v4": Chip("v4", 32 * GiB, int(30.75 * GiB), 275e12, 1200 * GB, 9e10, "ICI", ("TPU v4",)),
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s,
    # 400 GB/s bidirectional ICI per chip over 4 ports = 1e11 bidi per link (scaling book: 1e11).
    # Usable: libtpu 0.0.42 on v5e:2x2, "available HBM (15.75G)".
    "v5e": Chip("v5e", 16 * GiB, int(15.75 * GiB), 197e12, 819 * GB, 1e11, "ICI", ("TPU v5 lite", "TPU v5e")),
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, HBM2e at 2765 GB/s ("95 GB"; the
    # compiler's hard limit, taken as nominal, is 96 GiB: "would exceed memory (size=103079215104)"),
    # 1200 GB/s bidirectional ICI per chip over 6 ports = 2e11 bidi per link (scaling book: 2e11).
    # Usable: libtpu 0.0.42 on v5p:2x2x1, "available HBM (95.74G)".
    "v5p": Chip("v5p", 96 * GiB, int(95.74 * GiB), 459e12, 2765 * GB, 2e11, "ICI", ("TPU v5", "TPU v5p")),
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s,
    # 800 GB/s bidirectional ICI per chip over 4 ports = 2e11 bidi per link (scaling book: 2e11).
    # Usable: libtpu 0.0.42 on v6e:2x2, "available HBM (31.25G)".
    "v6e": Chip("v6e", 32 * GiB, int(31.25 * GiB), 918e12, 1638 * GB, 2e11, "ICI", ("TPU v6 lite", "TPU v6e")),
    # NVIDIA H100 SXM datasheet (https://www.nvidia.com/en-us/data-center/h100/): 80 GB HBM3 at
    # 3.35 TB/s, 989 TFLOP/s dense bf16 (1979 with sparsity), NVLink 900 GB/s = 450 GB/s one way.
    # Usable: the whole 80 GB; a CPU compile's numbers are only an estimate of a GPU's anyway.
    "h100": Chip("h100", 80 * GB, 80 * GB, 989e12, 3350 * GB, 450 * GB, "NVLink", ("NVIDIA H100 80GB HBM3",)),
    # NVIDIA A100 80GB SXM datasheet (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/
    # a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): 2039 GB/s, 312 TFLOP/s dense
    # bf16, NVLink 600 GB/s = 300 GB/s one way.
    "a100": Chip("a100", 80 * GB, 80 * GB, 312e12, 2039 * GB, 300 * GB, "NVLink",
                 ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")),
}


def get_chip(name: str) -> Chip:
    key = name.strip().lower()
    if key not in CHIPS:
        raise ValueError(f"unknown chip {name!r}; known chips: {', '.join(CHIPS)}")
    return CHIPS[key]


def chip_for_device_kind(kind: str) -> Chip | None:
    """The chip whose jax `device_kind` is `kind` (e.g. "TPU v5"), or None (a CPU, or unknown)."""
    for chip in CHIPS.values():
        if kind in chip.device_kinds:
            return chip
    return None
