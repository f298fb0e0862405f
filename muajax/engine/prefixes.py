"""The engine's shared prefixes (`Engine.register_prefix`), as a mixin of `Engine`.

`register_prefix(tokens)` (e.g. the system prompt): the first conversation that starts with
it gets the prefix computed once, for the current params, into pages that every
conversation starting with it then shares (full pages only, reference counted; see
engine.py's module docstring). Assigning new `params` invalidates the computed copies. A
recording engine (`record_experts`) gives each conversation placed on a copy that copy's
experts.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import jax

from muajax.engine.pages import PagedSeq, SharedPrefix


class SharedPrefixes:
    """Engine's shared-prefix methods; the engine holds `_prefixes`, `_prefix_params`,
    `pages`, `params`, `stats`, `spec`, `_experts` and `_extend`."""

    def register_prefix(self, tokens: Sequence[int]) -> None:
        """Share the full pages of `tokens` among the conversations that start with them."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens or len(tokens) > self.max_len:
            raise ValueError(f"a prefix needs 1..max_len={self.max_len} tokens, got {len(tokens)}")
        if all(p.tokens != tokens for p in self._prefixes):
            self._prefixes.append(SharedPrefix(tokens, len(tokens) // self.page_size * self.page_size))

    def clear_prefixes(self) -> None:
        self._drop_prefix_copies()
        self._prefixes = []

    def _drop_prefix_copies(self) -> None:
        for prefix in self._prefixes:
            for copy in prefix.copies.values():
                self.pages.drop(copy)
            prefix.copies = {}

    def _params_changed(self) -> bool:
        leaves = jax.tree.leaves(self.params)
        same = len(leaves) == len(self._prefix_params) and all(r() is x for r, x in zip(self._prefix_params, leaves))
        self._prefix_params = [weakref.ref(x) for x in leaves]
        return not same

    def _place(self, seq: PagedSeq) -> None:
        """Choose a shard for a sequence without pages, on a shared prefix's pages if one matches."""
        tokens = seq.queued
        prefix = max((p for p in self._prefixes if p.matches(tokens)), key=lambda p: p.full_tokens, default=None)
        if prefix is not None:
            if self._params_changed():
                self._drop_prefix_copies()
            if not prefix.copies:
                self._compute_prefix(prefix)
        if prefix is None or not prefix.copies:
            self.pages.place(seq)
            return
        shard = self.pages.emptiest(sorted(prefix.copies))
        self.pages.adopt(seq, shard, prefix.copies[shard].pages, prefix.tokens[: prefix.full_tokens])
        if self._experts is not None:
            self._experts.copy(prefix.copies[shard], seq, prefix.full_tokens)
        self.stats["prefix_hits"] += 1

    def _compute_prefix(self, prefix: SharedPrefix) -> None:
        """One copy per shard with room, all extended by one batched extend."""
        copies = {}
        for shard in range(self.spec.pool.num_shards):
            seq = PagedSeq(priority=-1, queued=list(prefix.tokens[: prefix.full_tokens]), shard=shard)
            if self.pages.grow(seq, prefix.full_tokens):
                copies[shard] = seq
        self._extend(list(copies.values()), keep_last=False)
        prefix.copies = copies
        self.stats["prefix_prefill_tokens"] += prefix.full_tokens * len(copies)

