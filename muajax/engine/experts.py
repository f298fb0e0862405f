"""A mixture of experts' chosen experts, kept per conversation on the host
(`Engine(record_experts=True)`; see programs.py for the device side).

Every extend and decode of a recording engine returns, for each token it computed, the
experts each layer routed it to ([L, k], the router's top k in its order). `ExpertLog`
writes them at the token's position in its sequence, so a conversation's log holds one row
per token in its cache: the prompt, user and tool turns (extends) and every sampled token
but the newest (each is fed back by the next decode step, or by the next turn's extend).
A training forward over the conversation replays them (routing replay, `grpo.routing_replay`).

A token recomputed after a preemption overwrites its row (the recomputed cache is the one
later tokens read); a conversation placed on a shared prefix's pages gets that prefix's rows
(the prefix ran once, for all of them). Rows are stored in `expert_dtype`: uint8 up to 256
experts (Qwen3-MoE has 128), else int16: 48 layers x 8 experts is 384 bytes a token.
"""
from __future__ import annotations

import weakref

import numpy as np


def expert_dtype(cfg) -> np.dtype:
    """The smallest integer dtype holding `cfg.num_experts` expert ids."""
    return np.dtype(np.uint8 if cfg.num_experts <= 256 else np.int16)


class ExpertLog:
    """Experts [positions, L, k] per sequence (any hashable, weakly referenced: a sequence
    that is gone takes its rows with it). Arrays grow by doubling up to `max_len`."""

    def __init__(self, cfg, max_len: int):
        self.shape = (cfg.num_layers, cfg.num_experts_per_tok)
        self.dtype, self.max_len = expert_dtype(cfg), max_len
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def write(self, seq, start: int, experts: np.ndarray) -> None:
        """Rows [start, start + n) of `seq` are `experts` [n, L, k]."""
        end = start + len(experts)
        rows = self._rows.get(seq)
        if rows is None or len(rows) < end:
            grown = np.zeros((min(self.max_len, max(end, 64, 2 * (0 if rows is None else len(rows)))), *self.shape),
                             self.dtype)
            if rows is not None:
                grown[: len(rows)] = rows
            self._rows[seq] = rows = grown
        rows[start:end] = experts

    def read(self, seq, length: int) -> np.ndarray:
        """A copy of `seq`'s first `length` rows [length, L, k]."""
        rows = self._rows.get(seq)
        if rows is None or len(rows) < length:
            raise KeyError(f"no experts recorded for {length} positions of this sequence")
        return rows[:length].copy()

    def copy(self, source, target, length: int) -> None:
        """`target`'s first `length` rows become `source`'s (a shared prefix's)."""
        self.write(target, 0, self.read(source, length))

    def record_extend(self, seqs, lengths: np.ndarray, num_new: np.ndarray, experts: np.ndarray) -> None:
        """An extend's experts [R, W, L, k]: row r wrote `num_new[r]` tokens of `seqs[r]` from
        position `lengths[r]` (None rows are padding)."""
        for r, seq in enumerate(seqs):
            if seq is not None and num_new[r]:
                self.write(seq, int(lengths[r]), experts[r, : int(num_new[r])])

    def record_decode(self, seq, start: int, count: int, experts: np.ndarray) -> None:
        """A decode row's experts [steps, L, k]: its first `count` steps fed positions
        `start`, `start + 1`, ..."""
        if count:
            self.write(seq, start, experts[:count])
