"""The record a tiny pretrained base keeps of the built-in shops it saw (`muajax_base.json`).

`python -m muajax.pretrain` writes it beside the HF weights; a run on one of those shops
is refused, since its held-out tasks would not be held out.
"""
from __future__ import annotations

import json
import os

BASE_META_FILE = "muajax_base.json"


def read_base_record(model_dir: str) -> dict | None:
    """The record of the base in `model_dir`, or None when it has none (any other checkpoint)."""
    path = os.path.join(model_dir, BASE_META_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_base_record(model_dir: str, record: dict) -> None:
    """Written whole: a reader never sees half a record."""
    tmp = os.path.join(model_dir, BASE_META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(model_dir, BASE_META_FILE))


def seen_shops(model_dir: str) -> list[int]:
    """Database seeds of the shops the base in `model_dir` was pretrained on ([] if none)."""
    record = read_base_record(model_dir)
    return list(record.get("shop_seeds", [])) if record else []
