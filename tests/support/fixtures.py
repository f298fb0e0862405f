"""Session-scoped fixtures shared by every test module (a pytest plugin: tests/conftest.py
names it in `pytest_plugins`).

- `tokenizer`: the real Qwen3 tokenizer (`muajax.models.tokenizer.load_tokenizer()`).
- `hf_checkpoint(seed=..., **overrides)`: the folder of a random tiny HF checkpoint
  (`make_hf_checkpoint`), built once per session per arguments. Read it, never write to it:
  a test that changes a checkpoint builds its own with `make_hf_checkpoint(tmp_path, ...)`.
- `tiny_hf_dir`: `hf_checkpoint()`, the one tiny HF checkpoint (seed 11).
"""
from __future__ import annotations

import pytest

from tests.support.tiny_models import make_hf_checkpoint

TINY_HF_SEED = 11


@pytest.fixture(scope="session")
def tokenizer():
    from muajax.models.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    built: dict[tuple, str] = {}

    def checkpoint(seed: int = TINY_HF_SEED, **overrides) -> str:
        key = (seed, *sorted(overrides.items(), key=lambda kv: kv[0]))
        if key not in built:
            built[key] = make_hf_checkpoint(str(tmp_path_factory.mktemp(f"hf-seed{seed}")), seed=seed, **overrides)
        return built[key]

    return checkpoint


@pytest.fixture(scope="session")
def tiny_hf_dir(hf_checkpoint) -> str:
    return hf_checkpoint()
