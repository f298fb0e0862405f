import dataclasses

import pytest

from muajax.chips import CHIPS, chip_for_device_kind, get_chip


def test_every_chip_is_complete_and_usable_below_nominal():
    for chip in CHIPS.values():
        for field in dataclasses.fields(chip):
            value = getattr(chip, field.name)
            assert value, (chip.name, field.name)
        assert 0 < chip.usable_hbm_bytes <= chip.hbm_bytes
        assert chip.peak_flops > chip.hbm_bytes_per_s > chip.ring_bytes_per_s  # FLOPs outrun bytes outrun links


def test_lookups():
    assert chip_for_device_kind("TPU v5").name == "v5p"
    assert chip_for_device_kind("TPU v6 lite").name == "v6e"
    assert chip_for_device_kind("cpu") is None
    assert get_chip("H100").name == "h100"
    with pytest.raises(ValueError, match="known chips"):
        get_chip("v7x")
