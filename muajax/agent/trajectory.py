"""One rollout's record (`Trajectory`), batching for the GRPO step, and per-step rollout metrics.

A trajectory's `tokens` are the conversation exactly as the engine was fed it: system
prompt, every turn delta, and every sampled token (never re-tokenized from text).
`loss_mask[t]` is 1 exactly where `tokens[t]` was sampled by the agent (its closing
`<|im_end|>` included) and `logprobs[t]` is the rollout policy's logprob of `tokens[t]`
(0 where the mask is 0), indexed by the token they describe, as `muajax.rl.step` expects.
With routing replay (a mixture of experts, `grpo.routing_replay`), `experts` [n, L, k] holds
the experts the engine routed each of the first n tokens to in each layer (every token it
computed: prompt, user and tool turns and sampled tokens alike; the newest token, never fed
back, is not among them), which the training forward then uses (`muajax.runtime.host_batch`).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from muajax.domains.base import WRITES_CONFIRMED, confirm_before_write_rate

# Why an episode ended. The first group are normal ends; the errors mark episodes whose
# outcome says nothing about the policy (the trainer may drop or down-weight them).
USER_STOP = "user_stop"  # ###STOP###
USER_TRANSFER = "user_transfer"  # ###TRANSFER###
USER_OUT_OF_SCOPE = "user_out_of_scope"  # ###OUT-OF-SCOPE###
TRANSFER = "transfer"  # the agent called transfer_to_human_agents
ENV_DONE = "env_done"  # another tool observation with done=True
MALFORMED_CALL = "malformed_call"  # only with end_on_malformed_call
MAX_TURNS = "max_turns"
CONTEXT = "context"
USER_ERROR = "user_error"  # the simulated user could not answer (after its retries)
SETUP_ERROR = "setup_error"  # env.reset / user.start / the prompt failed
TERMINATIONS = (USER_STOP, USER_TRANSFER, USER_OUT_OF_SCOPE, TRANSFER, ENV_DONE, MALFORMED_CALL, MAX_TURNS,
                CONTEXT, USER_ERROR, SETUP_ERROR)
ERROR_TERMINATIONS = frozenset({USER_ERROR, SETUP_ERROR})
# Episodes that ended the way a conversation ends: τ2's evaluator scores only these (its
# AGENT_STOP / USER_STOP) and gives 0 to every other ending (max steps, too many errors,
# agent or user errors). τ2's USER_STOP is any of the user's three end tokens. The agent's
# transfer_to_human_agents ends a muajax episode at the tool (as MUA-RL does), where τ2's
# orchestrator goes on until the user, told of the transfer, answers ###TRANSFER###:
# the same ending one step earlier. ENV_DONE is a tool that ended the episode, which its
# domain's own evaluator then judges (BFCL scores its force-quit 0 itself). Cut-offs
# (max_turns, context), a malformed call that ended the episode, and failures are not.
FINISHED_TERMINATIONS = frozenset({USER_STOP, USER_TRANSFER, USER_OUT_OF_SCOPE, TRANSFER, ENV_DONE})


@dataclasses.dataclass
class Trajectory:
    task_id: str
    group_id: int  # the task's index in the rollout call: rollouts of one task share it
    rollout_index: int
    seed: int
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int  # tokens before the first assistant turn
    messages: list[dict[str, Any]]  # OpenAI style: user / assistant (tool_calls) / tool
    termination: str
    reward: float = 0.0
    partial: float = 0.0
    details: dict[str, Any] = dataclasses.field(default_factory=dict)  # Evaluation.details
    turns: int = 0  # user replies + tool observations (what max_turns counts)
    assistant_turns: int = 0
    truncated_turns: int = 0  # turns cut at max_new_tokens (closed by a host <|im_end|>)
    tool_calls: Counter = dataclasses.field(default_factory=Counter)
    malformed_calls: int = 0
    user_latency_s: list[float] = dataclasses.field(default_factory=list)
    assistant_texts: list[str] = dataclasses.field(default_factory=list)  # decoded, as routed
    sampled_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # [start, end) per turn
    # per sampled span: the oldest policy version (updates applied) among the weights that
    # sampled its tokens (the engine's `version`; several with partial rollouts)
    versions: list[int] = dataclasses.field(default_factory=list)
    error: str | None = None  # the user/setup/evaluation error behind an error termination
    wall_s: float = 0.0  # admission to end of episode
    domain: str = ""  # the task's domain (evaluations report each domain on its own)
    experts: np.ndarray | None = None  # [n <= len(tokens), L, k]: routing replay's (see the module docstring)

    @property
    def failed(self) -> bool:
        return self.termination in ERROR_TERMINATIONS

    @property
    def finished(self) -> bool:
        """Ended by the user, the agent's transfer or the environment (see FINISHED_TERMINATIONS)."""
        return self.termination in FINISHED_TERMINATIONS

    @property
    def user_latency_total_s(self) -> float:
        return float(sum(self.user_latency_s))

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version that sampled any of its tokens (None: it sampled none)."""
        return min(self.versions) if self.versions else None

    @property
    def num_sampled(self) -> int:
        return int(sum(self.loss_mask))

    def check(self) -> None:
        """Raise if the token-level fields disagree with each other (a bookkeeping bug)."""
        n = len(self.tokens)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"trajectory {self.task_id}/{self.rollout_index}: tokens, loss_mask and logprobs "
                             f"have lengths {n}, {len(self.loss_mask)}, {len(self.logprobs)}")
        in_spans = np.zeros(n, bool)
        for start, end in self.sampled_spans:
            in_spans[start:end] = True
        mask = np.asarray(self.loss_mask, bool)
        if not np.array_equal(mask, in_spans):
            raise ValueError(f"trajectory {self.task_id}/{self.rollout_index}: loss_mask disagrees with the "
                             "sampled spans")
        if self.experts is not None and (self.experts.ndim != 3 or len(self.experts) > n):
            raise ValueError(f"trajectory {self.task_id}/{self.rollout_index}: experts {self.experts.shape} for "
                             f"{n} tokens")
        if np.any(np.asarray(self.logprobs)[~mask] != 0.0):
            raise ValueError(f"trajectory {self.task_id}/{self.rollout_index}: nonzero logprob off the mask")


class RolloutBatch(list):
    """Trajectories (ordered by task, then rollout) plus `stats` of the rollout call that made
    them: wall_s, device_s (engine device time), busy_share = device_s / wall_s, token counts."""

    def __init__(self, trajectories: Iterable[Trajectory] = (), stats: dict[str, Any] | None = None):
        super().__init__(trajectories)
        self.stats = dict(stats or {})

    def metrics(self) -> dict[str, Any]:
        return {**rollout_metrics(self), "busy_share": self.stats.get("busy_share"),
                "wall_s": self.stats.get("wall_s")}


def _mean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else None


def confirm_rate(trajectories: Sequence[Trajectory]) -> float | None:
    """Share of the rollouts that wrote whose writes were all confirmed first (see
    `muajax.domains.base.confirm_before_write_rate`); None when none wrote."""
    return confirm_before_write_rate(t.details.get(WRITES_CONFIRMED) for t in trajectories
                                     if isinstance(t.details, dict))


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """The paper's per-step rollout metrics (nested dict; None where undefined)."""
    trajs = list(trajectories)
    groups: dict[tuple[str, int], list[float]] = {}
    for t in trajs:
        groups.setdefault((t.task_id, t.group_id), []).append(t.reward)
    calls: Counter = Counter()
    for t in trajs:
        calls.update(t.tool_calls)
    return {
        "reward": _mean(t.reward for t in trajs),
        "partial": _mean(t.partial for t in trajs),
        "all_correct_ratio": _mean(float(all(r >= 1.0 for r in rs)) for rs in groups.values()),
        "all_wrong_ratio": _mean(float(all(r <= 0.0 for r in rs)) for rs in groups.values()),
        "turns": _mean(t.turns for t in trajs),
        "assistant_turns": _mean(t.assistant_turns for t in trajs),
        "response_tokens": _mean(t.num_sampled for t in trajs),
        "sequence_tokens": _mean(len(t.tokens) for t in trajs),
        # the step's longest conversation: with the means, the spread a step-time model needs
        "longest": {"assistant_turns": max(t.assistant_turns for t in trajs),
                    "sequence_tokens": max(len(t.tokens) for t in trajs)} if trajs else {},
        "malformed_calls": _mean(t.malformed_calls for t in trajs),
        "truncated_turns": _mean(t.truncated_turns for t in trajs),
        "user_latency_s": _mean(x for t in trajs for x in t.user_latency_s),
        "failed_share": _mean(float(t.failed) for t in trajs),
        "failed_rollouts": sum(t.failed for t in trajs),
        "confirm_before_write_rate": confirm_rate(trajs),
        "calls": {name: n / max(len(trajs), 1) for name, n in sorted(calls.items())},
        "termination": {name: n / len(trajs) for name, n in sorted(Counter(t.termination for t in trajs).items())}
        if trajs else {},
    }
