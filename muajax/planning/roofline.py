"""A roofline estimate of one program's time on a chip, from its compiled costs.

Three terms, per device:
  compute     FLOPs (loops counted) / peak bf16 FLOP/s;
  memory      HBM bytes accessed (loops counted) / HBM bandwidth;
  collective  sum over collectives of (cost factor x bytes) / ring bandwidth (muajax/chips.py).
Collective cost factors, for a bidirectional ring over one mesh axis (the scaling book's
sharding chapter): all-gather and reduce-scatter move the whole array once (1); an
all-reduce is a reduce-scatter then an all-gather (2); an all-to-all moves a quarter as
much as an all-gather on a ring (1/4); a collective permute sends the array to a
neighbour (1; XLA's windowed einsums send both ways at once, one link each).

`estimate` is the largest term: the TPU overlaps matmuls with HBM streaming inside each
fusion, and XLA's scheduler overlaps collectives with compute (async collectives,
windowed einsums), so a well-scheduled step approaches the slowest resource. It is a
lower bound; `serial` (the sum, nothing overlapped) is the upper bound. Both are
estimates: they ignore latency, kernel efficiency and the MXU's shape constraints.
"""
from __future__ import annotations

from muajax.chips import Chip
from muajax.planning.compile import ProgramCost

COLLECTIVE_FACTORS = {"all-gather": 1.0, "reduce-scatter": 1.0, "all-reduce": 2.0, "all-to-all": 0.25,
                      "collective-permute": 1.0}


def roofline(cost: ProgramCost, chip: Chip) -> dict:
    """{"compute_s", "memory_s", "collective_s", "estimate_s", "serial_s", "bound"} for one call."""
    moved = sum(COLLECTIVE_FACTORS[kind] * b for kind, b in cost.collectives.items())
    terms = {"compute_s": cost.flops / chip.peak_flops, "memory_s": cost.bytes_accessed / chip.hbm_bytes_per_s,
             "collective_s": moved / chip.ring_bytes_per_s}
    bound = max(terms, key=terms.get)
    return {**terms, "estimate_s": terms[bound], "serial_s": sum(terms.values()), "bound": bound[: -len("_s")],
            "chip": chip.name}
