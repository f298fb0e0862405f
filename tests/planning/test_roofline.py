import pytest

from muajax.chips import get_chip
from muajax.planning.compile import ProgramCost
from muajax.planning.roofline import roofline


def test_terms_and_bound():
    chip = get_chip("v5p")
    cost = ProgramCost("p", "tpu", {}, {}, flops=459e12, bytes_accessed=2765e9 * 3,
                       collectives={"all-gather": 1e11, "all-reduce": 1e11, "all-to-all": 4e11,
                                    "reduce-scatter": 0.0, "collective-permute": 2e11})
    line = roofline(cost, chip)
    assert line["compute_s"] == pytest.approx(1.0)
    assert line["memory_s"] == pytest.approx(3.0)
    # (1 + 2 x 1 + 4 / 4 + 2) x 1e11 bytes over a 2e11 B/s ring
    assert line["collective_s"] == pytest.approx(3.0)
    assert line["estimate_s"] == pytest.approx(3.0) and line["bound"] in ("memory", "collective")
    assert line["serial_s"] == pytest.approx(7.0)
