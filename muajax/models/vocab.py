"""A domain vocabulary: the subset of Qwen3's token ids a small domain actually uses.

A tiny CPU model with Qwen3's full 151,936-row head spends almost all its time and
parameters on ids the built-in domain never produces. `DomainVocab` keeps the real
Qwen3 tokenizer (same text, same token boundaries) and renumbers the ids that occur in
the domain's text into a compact range, so the model's head is a few hundred rows wide.
`DomainTokenizer` wraps the tokenizer so that everything downstream (chat format,
engine, rollout, trainer) works in compact ids without knowing it. Ids outside the
domain map to one UNK id, which decodes to U+FFFD.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from muajax.models.tokenizer import IM_END_ID, IM_START_ID, PAD_ID

# A Hugging Face directory of a domain-vocabulary model carries its vocabulary in this file
# (the tokenizer's own vocab.json is a different thing).
DOMAIN_VOCAB_FILE = "domain_vocab.json"
# Qwen3's tool and think markers: always kept so the chat format stays intact.
_QWEN3_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
UNK_TEXT = "\ufffd"


class DomainVocab:
    def __init__(self, qwen_ids: Iterable[int]):
        ids = sorted(set(int(i) for i in qwen_ids) | {PAD_ID, IM_START_ID, IM_END_ID})
        self.qwen_ids = np.asarray(ids, np.int64)
        self.unk_id = len(ids)  # one extra row for everything outside the domain
        self._to_compact = {q: i for i, q in enumerate(ids)}

    @property
    def size(self) -> int:
        return len(self.qwen_ids) + 1

    def padded_size(self, multiple: int = 128) -> int:
        """Model vocab size: rounded up so that the head shards evenly and matmuls tile well."""
        return -(-self.size // multiple) * multiple

    def to_compact(self, ids: Sequence[int]) -> list[int]:
        return [self._to_compact.get(int(i), self.unk_id) for i in ids]

    def to_qwen(self, ids: Sequence[int]) -> list[int]:
        n = len(self.qwen_ids)
        return [int(self.qwen_ids[i]) if 0 <= i < n else -1 for i in ids]

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"qwen_ids": self.qwen_ids.tolist()}, f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "DomainVocab":
        with open(path) as f:
            return cls(json.load(f)["qwen_ids"])

    @classmethod
    def from_texts(cls, tokenizer, texts: Iterable[str], extra_ids: Iterable[int] = ()) -> "DomainVocab":
        ids: set[int] = set(extra_ids)
        for text in texts:
            ids.update(tokenizer.encode(text, add_special_tokens=False))
        ids.update(tokenizer.convert_tokens_to_ids(m) for m in _QWEN3_MARKERS)
        # every single character of ASCII, so numbers and ids never fall outside the vocabulary
        for ch in (chr(c) for c in range(32, 127)):
            ids.update(tokenizer.encode(ch, add_special_tokens=False))
        return cls(ids)


class DomainTokenizer:
    """The real Qwen3 tokenizer, speaking compact ids (the subset `encode`/`decode` API)."""

    def __init__(self, tokenizer, vocab: DomainVocab):
        self.base = tokenizer
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.vocab.to_compact(self.base.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **kwargs) -> str:
        parts, run = [], []
        for q in self.vocab.to_qwen(ids):
            if q < 0:
                if run:
                    parts.append(self.base.decode(run, skip_special_tokens=skip_special_tokens, **kwargs))
                    run = []
                parts.append(UNK_TEXT)
            else:
                run.append(q)
        if run:
            parts.append(self.base.decode(run, skip_special_tokens=skip_special_tokens, **kwargs))
        return "".join(parts)

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.vocab.to_compact([self.base.convert_tokens_to_ids(token)])[0]

    @property
    def eos_token_id(self) -> int:
        return self.vocab.to_compact([IM_END_ID])[0]

    @property
    def pad_token_id(self) -> int:
        return self.vocab.to_compact([PAD_ID])[0]

    def __len__(self) -> int:
        return self.vocab.size


def checkpoint_tokenizer(hf_dir: str):
    """The tokenizer of an HF checkpoint directory: its own or the bundled Qwen3 one, wrapped
    in a `DomainTokenizer` when the directory carries a domain vocabulary."""
    from muajax.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(os.path.abspath(hf_dir))
    path = os.path.join(hf_dir, DOMAIN_VOCAB_FILE)
    return DomainTokenizer(tokenizer, DomainVocab.load(path)) if os.path.isfile(path) else tokenizer
