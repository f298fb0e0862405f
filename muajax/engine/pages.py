"""Host-side bookkeeping of the paged KV cache: the page pool, each sequence's page table,
reference counts, preemption, and shared prefixes. Nothing here touches a device.

The pool is split into equal *shards*, one per data-parallel group of devices (the mesh's
data x fsdp): a sequence's pages all live in one shard, so its cache writes and its
attention stay on the devices that hold them. Page ids are local to their shard.

A page is shared when more than one sequence lists it (a shared prefix's full pages): its
reference count is the number of holders, and it returns to its shard's free list when
the last holder lets go. Only full pages are ever shared, and a sequence only writes at
positions past its own length, so a shared page is never written.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np


class PagePool:
    """Free lists and reference counts of `num_shards` x `pages_per_shard` pages."""

    def __init__(self, num_shards: int, pages_per_shard: int):
        if num_shards < 1 or pages_per_shard < 1:
            raise ValueError(f"need at least one shard and one page, got {num_shards} x {pages_per_shard}")
        self.num_shards, self.pages_per_shard = num_shards, pages_per_shard
        # a stack: the most recently returned page is handed out first (its memory is warm)
        self._free = [list(range(pages_per_shard - 1, -1, -1)) for _ in range(num_shards)]
        self._refs = np.zeros((num_shards, pages_per_shard), np.int32)

    def free(self, shard: int) -> int:
        return len(self._free[shard])

    @property
    def in_use(self) -> int:
        return self.num_shards * self.pages_per_shard - sum(map(len, self._free))

    def refcount(self, shard: int, page: int) -> int:
        return int(self._refs[shard, page])

    def take(self, shard: int, count: int) -> list[int]:
        if count > len(self._free[shard]):
            raise RuntimeError(f"shard {shard} has {len(self._free[shard])} free pages, {count} asked")
        pages = [self._free[shard].pop() for _ in range(count)]
        self._refs[shard, pages] = 1
        return pages

    def share(self, shard: int, pages: Iterable[int]) -> None:
        for page in pages:
            if self._refs[shard, page] < 1:
                raise RuntimeError(f"page {page} of shard {shard} is free: it cannot be shared")
            self._refs[shard, page] += 1

    def give_back(self, shard: int, pages: Iterable[int]) -> None:
        for page in pages:
            if self._refs[shard, page] < 1:
                raise RuntimeError(f"page {page} of shard {shard} is already free")
            self._refs[shard, page] -= 1
            if self._refs[shard, page] == 0:
                self._free[shard].append(page)


@dataclasses.dataclass(eq=False)
class PagedSeq:
    """A sequence of tokens on its way into (`queued`) or already in (`cached`) the pool.

    `priority` orders sequences for preemption (lower = older = kept longer). `cached` is
    kept on the host so that a preempted sequence can be extended again from its tokens."""

    priority: int
    queued: list[int] = dataclasses.field(default_factory=list)
    cached: list[int] = dataclasses.field(default_factory=list)
    shard: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.cached)


class PageTables:
    """Pages for sequences: growth, preemption, and the page-table rows the device reads."""

    def __init__(self, pool: PagePool, page_size: int, max_pages: int):
        if max_pages > pool.pages_per_shard:
            raise ValueError(f"a shard has {pool.pages_per_shard} pages but one sequence may need {max_pages} "
                             f"(max_len / page_size): give the pool more tokens")
        self.pool, self.page_size, self.max_pages = pool, page_size, max_pages
        self.preemptions = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def emptiest(self, candidates: Sequence[int] | None = None) -> int:
        """The shard (of `candidates`) with the most free pages; the lowest index on ties."""
        shards = range(self.pool.num_shards) if candidates is None else candidates
        return max(shards, key=lambda s: (self.pool.free(s), -s))

    def place(self, seq: PagedSeq) -> int:
        """Put a sequence without pages in the shard with the most free pages."""
        if seq.pages:
            raise RuntimeError("a sequence holding pages cannot move to another shard")
        seq.shard = self.emptiest()
        return seq.shard

    def shortfall(self, seq: PagedSeq, tokens: int) -> int:
        """Pages the sequence still needs to hold `tokens` tokens."""
        return max(self.pages_for(tokens) - len(seq.pages), 0)

    def grow(self, seq: PagedSeq, tokens: int) -> bool:
        """Take pages (from the sequence's shard) until it can hold `tokens`; False if too few are free."""
        if tokens > self.max_pages * self.page_size:
            raise ValueError(f"{tokens} tokens exceed a sequence's {self.max_pages} pages")
        missing = self.shortfall(seq, tokens)
        if missing > self.pool.free(seq.shard):
            return False
        seq.pages.extend(self.pool.take(seq.shard, missing))
        return True

    def adopt(self, seq: PagedSeq, shard: int, pages: Sequence[int], tokens: Sequence[int]) -> None:
        """Start an empty sequence on shared full pages that already hold `tokens`."""
        if seq.pages or seq.cached:
            raise RuntimeError("only an empty sequence can adopt shared pages")
        if len(tokens) != len(pages) * self.page_size or seq.queued[: len(tokens)] != list(tokens):
            raise RuntimeError("shared pages must be full and hold the sequence's first tokens")
        self.pool.share(shard, pages)
        seq.shard, seq.pages = shard, list(pages)
        seq.cached, seq.queued = list(tokens), seq.queued[len(tokens):]

    def drop(self, seq: PagedSeq) -> None:
        """Let go of every page; what was cached goes back to the front of the queue."""
        if seq.pages:
            self.pool.give_back(seq.shard, seq.pages)
        seq.queued = seq.cached + seq.queued
        seq.cached, seq.pages, seq.shard = [], [], None

    def preempt_for(self, seq: PagedSeq, tokens: int, victims: Iterable[PagedSeq]) -> list[PagedSeq]:
        """Drop victims (in the given order, those in the sequence's shard) until it can hold
        `tokens`; returns the dropped ones. Stops early if enough pages are free."""
        dropped = []
        for victim in victims:
            if self.shortfall(seq, tokens) <= self.pool.free(seq.shard):
                break
            if victim is seq or victim.shard != seq.shard or not victim.pages:
                continue
            self.drop(victim)
            self.preemptions += 1
            dropped.append(victim)
        return dropped

    def rows(self, seqs: Sequence[PagedSeq | None], width: int) -> np.ndarray:
        """Page-table rows [len(seqs), width] (local page ids; unused entries 0, never read)."""
        table = np.zeros((len(seqs), width), np.int32)
        for i, seq in enumerate(seqs):
            if seq is not None and seq.pages:
                table[i, : len(seq.pages)] = seq.pages
        return table


@dataclasses.dataclass(eq=False)
class SharedPrefix:
    """A registered prefix (e.g. the system prompt) and its computed copies: one sequence per
    shard holding the prefix's full pages, valid for the params they were computed with."""

    tokens: tuple[int, ...]
    full_tokens: int  # the part that fills whole pages: the only part ever shared
    copies: dict[int, PagedSeq] = dataclasses.field(default_factory=dict)

    def matches(self, tokens: Sequence[int]) -> bool:
        """Whether a conversation starting with `tokens` can share the prefix's pages (it must
        keep at least one token of its own: the cache never holds a conversation's last token)."""
        n = self.full_tokens
        return n > 0 and len(tokens) > n and tuple(tokens[:n]) == self.tokens[:n]
