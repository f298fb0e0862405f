"""How rollouts run: the `rollout:` section of a run config, also built directly in code."""
from __future__ import annotations

import dataclasses

from typing import Literal

from muajax.settings.fields import Checked, bounded, check
from muajax.engine.engine import SamplingParams
from muajax.engine.paged_attention import ATTENTION_CHOICES


@dataclasses.dataclass(frozen=True)
class RolloutMeshConfig(Checked):
    """The engine's own layout: axis sizes over one process's devices (-1: the rest)."""

    data: int = 1  # conversations split over this many devices, weights replicated
    fsdp: int = 1  # conversations split over this many devices, weights sharded
    tensor: int = -1  # tensor parallelism over heads, MLP width and vocabulary

    def validate(self) -> None:
        sizes = {n: getattr(self, n) for n in ("data", "fsdp", "tensor")}
        for name, size in sizes.items():
            check(size == -1 or size >= 1, name, f"must be >= 1 or -1 (the rest of the devices), got {size}")
        check(list(sizes.values()).count(-1) <= 1, "data", "at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Checked):
    """How rollouts run: the GRPO group, turn and length limits, sampling and the engine."""

    n_per_task: int = bounded(8, ge=1)  # rollouts per task: the GRPO group
    tasks_per_step: int = bounded(32, ge=1)  # tasks of one GRPO step (the trainer's)
    max_turns: int = bounded(30, ge=1)  # turns per episode; user replies and tool observations both count
    max_new_tokens_per_turn: int = bounded(1024, ge=1)  # tokens the agent may sample in one turn
    max_context: int = bounded(32768, ge=2)  # tokens of one conversation, prompt included
    # sampling (checked by the engine's `SamplingParams`, the one place its rules live):
    temperature: float = 1.0  # the rollouts' sampling temperature (1: the policy's own distribution)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much mass; 1 = off
    top_k: int = 0  # sample from the k likeliest tokens; 0 = no top-k truncation
    # End the episode at a malformed tool call, as the released code does; False: an error
    # observation (friendlier).
    end_on_malformed_call: bool = False
    # Rollouts whose user or setup failed (user_error, setup_error) are left out of the update;
    # when more than this share of a step's rollouts failed, training stops (after saving).
    max_failed_share: float = bounded(0.5, ge=0, le=1)
    # Run every tool call of a message, in order (τ2's orchestrator and BFCL do). False is
    # MUA-RL's training rollout: only the first call of a message runs.
    execute_all_calls: bool = False
    # Score 0 an episode that did not end as a conversation ends (see
    # `trajectory.FINISHED_TERMINATIONS`), as τ2's evaluator does. False is MUA-RL's training
    # reward: the final database is judged whatever ended the episode (e.g. max_turns).
    zero_unfinished: bool = False
    num_slots: int | None = bounded(None, ge=1)  # concurrent KV slots; None = all rollouts of a step
    # τ-bench's check that required facts were told to the user, in the reward: off in
    # training, as MUA-RL ran it (evaluation turns it on with `eval.communicate_info`).
    communicate_info: bool = False
    system_text: str | None = None  # the agent's system prompt; None = the domain's policy
    user_timeout_s: float | None = bounded(None, gt=0)  # seconds for one whole user turn, on top of the simulator's own
    tool_workers: int = bounded(8, ge=1)  # threads for tool calls and evaluation
    # False = the reference mode that waits for every pending user reply / tool result
    # before decoding anything else (the benchmark's baseline; also handy when debugging).
    overlap_io: bool = True
    # The engine (muajax.engine). Its KV page pool, in tokens, for the step's conversations
    # (split evenly over processes); None: every slot can reach max_context (nothing is ever
    # preempted). Or `kv_cache_share`: that share of the free accelerator memory, per device,
    # where the backend reports it (device.memory_stats()).
    kv_cache_tokens: int | None = bounded(None, ge=1)
    kv_cache_share: float | None = bounded(None, gt=0, le=1)  # the pool as this share of free memory
    page_size: int | None = bounded(None, ge=1)  # tokens per KV page; None: 128 with the Pallas kernel, else 16
    attention: Literal[ATTENTION_CHOICES] = "auto"  # the engine's; auto: the Pallas kernel on TPU, else pure JAX
    # The engine's layout over one process's devices (several processes: one engine each);
    # None: tensor parallel over a host's devices on TPU and GPU, the training mesh on CPU.
    mesh: RolloutMeshConfig | None = None
    keep_kv_pool: bool = False  # keep the pool through the train step (else freed, made again)
    # A conversation's numbers do not depend on which others share its engine calls: same
    # config and seed, same bits, whatever the timing of users and tools (while nothing is
    # preempted). False: packed calls, each dot over the whole call (rounding follows the schedule).
    deterministic: bool = True
    # How deterministic calls are made: "packed" computes every token-wise step in fixed tiles
    # (muajax/models/token_tiles.py) and only the tiles that hold tokens; "fixed_rows" (the
    # older way, kept for backends where tiles do not make a row's numbers batch-invariant)
    # gives every call all of a shard's slots as rows and computes the padding too.
    call_layout: Literal["packed", "fixed_rows"] = "packed"
    # Tokens per row of a packed extend, and rows per decode tile with token tiles; each tile
    # reads every weight again. None: by platform (muajax.engine.batching.TILES: 16 and 2 on
    # CPU, 128 and every slot on an accelerator, where a step is bound by reading the weights).
    extend_tile: int | None = bounded(None, ge=1)
    decode_tile: int | None = bounded(None, ge=1)  # rows per decode tile (see extend_tile)
    # Partial rollouts (with grpo.max_staleness >= 1): a conversation in flight when an update
    # publishes new weights goes on with them from the engine's next call (its tokens keep
    # the version and logprobs that sampled them; its KV cache stays as computed). Timing
    # dependent by nature: which tokens get which weights depends on when updates finish,
    # so runs are not bitwise repeatable and multi-host processes may differ. False: a batch
    # rolls out entirely on the weights it started with (deterministic).
    partial: bool = False

    def validate(self) -> None:
        try:
            self.sampling(1)
        except ValueError as e:
            field = next((n for n in ("temperature", "top_p", "top_k") if n in str(e)), "temperature")
            check(False, field, str(e).removeprefix(field + " "))
        check(self.max_new_tokens_per_turn < self.max_context, "max_new_tokens_per_turn",
              f"({self.max_new_tokens_per_turn}) must be smaller than max_context ({self.max_context})")
        check(self.kv_cache_tokens is None or self.kv_cache_share is None, "kv_cache_share",
              "conflicts with kv_cache_tokens: size the pool one way")

    @classmethod
    def for_engine(cls, max_len: int, **values) -> RolloutConfig:
        """The defaults, fitted to an engine of `max_len` tokens per conversation."""
        values.setdefault("max_context", max_len)
        values.setdefault("max_new_tokens_per_turn", min(cls.max_new_tokens_per_turn, values["max_context"] - 1))
        return cls(**values)

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=max_new_tokens)
