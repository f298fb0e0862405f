"""What a run directory says about its conversations: its metrics.jsonl and its config.yaml
(`RolloutProfile.from_run` builds the profile from `run_numbers`).

metrics.jsonl (`muajax.train.grpo`, `muajax.agent.trajectory.rollout_metrics`) gives per
step the means per conversation of agent turns, turns (user replies + tool results),
sampled tokens, sequence tokens, tool calls by name and the user's latency per reply, and
(`longest/...`, where the run logged them) the step's longest conversation in agent turns
and tokens. config.yaml gives the domain, from which the system prompt and the first user
messages are tokenized as the rollout tokenizes them. The context fed after each agent turn
is what the sequence holds beyond the prompt, the sampled tokens and the chat template's
turn tokens, shared out over the replies (tool results and user replies alike: the metrics
do not tell them apart).
"""
from __future__ import annotations

import json
import os
import statistics

from muajax.agent.chat import after_assistant_ids, generation_prompt_ids, system_prompt_ids, user_turn_ids

KEYS = ("assistant_turns", "turns", "response_tokens", "sequence_tokens")
METRICS_FILE = "metrics.jsonl"  # muajax.train.metrics.JSONL_NAME
SFT_FILE = "sft.jsonl"  # the run's cold-start conversations (muajax.train.sft), when it made them


class ProfileError(ValueError):
    """A profile that cannot be read or made: the message names the file and what is wrong."""


def turn_overhead(tok) -> int:
    """Tokens the host adds per agent turn: the newline after `<|im_end|>` and the next
    generation prompt (`muajax.agent.chat`)."""
    return len(after_assistant_ids(tok)) + len(generation_prompt_ids(tok))


def prompt_tokens(config_path: str) -> tuple[int, list[int], int]:
    """(system prompt tokens, each training task's first user turn tokens, turn overhead) of
    the run whose config is `config_path`, with the Qwen3 tokenizer (a domain vocabulary
    renumbers its ids, not its boundaries)."""
    from muajax.config.schema import load_config
    from muajax.domains.registry import make_environment
    from muajax.models.tokenizer import load_tokenizer

    cfg = load_config(config_path, [])
    env, tok = make_environment(cfg.env), load_tokenizer()
    tasks = env.tasks(cfg.env.train_split)
    if not tasks:
        raise ProfileError(f"{config_path}: the run's training split has no tasks")
    session = env.reset(tasks[0])
    try:
        text = cfg.rollout.system_text if cfg.rollout.system_text is not None else env.policy_for(tasks[0])
        system = len(system_prompt_ids(tok, text or None, session.tools()))
    finally:
        session.close()
    firsts = [len(user_turn_ids(tok, t.first_user_message)) for t in tasks if t.first_user_message]
    return system, firsts or [0], turn_overhead(tok)


def read_records(run_dir: str) -> list[dict]:
    """The step records of `run_dir/metrics.jsonl` (lines that do not parse are skipped, as
    `muajax.train.metrics.read_metrics` skips them)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ProfileError(f"{run_dir}: no {METRICS_FILE}")
    records = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def message_tokens(path: str, tok) -> dict[str, list[int]]:
    """Tokens of each message of a conversations file (a run's sft.jsonl: OpenAI-style
    messages) as the rollout feeds or samples them: "agent" per assistant message (its text
    and tool calls, `<|im_end|>` included), "tool" per turn of consecutive tool results,
    "user" per user message after the first."""
    from muajax.agent.assistant_format import assistant_text
    from muajax.agent.chat import tool_response_ids
    from muajax.domains.base import ToolCall

    out: dict[str, list[int]] = {"agent": [], "tool": [], "user": []}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            messages = json.loads(line).get("messages") or []
            results: list[str] = []
            for i, m in enumerate(messages + [{"role": "end"}]):
                if m["role"] != "tool" and results:
                    out["tool"].append(len(tool_response_ids(tok, results)))
                    results = []
                if m["role"] == "tool":
                    results.append(str(m.get("content") or ""))
                elif m["role"] == "user" and i > 0:
                    out["user"].append(len(user_turn_ids(tok, str(m.get("content") or ""))))
                elif m["role"] == "assistant":
                    calls = [ToolCall(c["function"]["name"], json.loads(c["function"].get("arguments") or "{}"))
                             for c in m.get("tool_calls") or []]
                    text = assistant_text(m.get("content"), calls)
                    out["agent"].append(len(tok.encode(text, add_special_tokens=False)) + 1)
    return out


def _mean(records, key: str) -> float:
    return statistics.fmean(float(r[key]) for r in records)


def _longest(records, key: str) -> float | None:
    values = [float(r[f"longest/{key}"]) for r in records if f"longest/{key}" in r]
    return statistics.median(values) if values else None


def run_numbers(run_dir: str, *, skip_first: int = 0) -> dict:
    """The run's conversations in numbers: means over its GRPO steps, the median step's
    longest conversation (None where not logged), its prompt's tokens, and `sources`."""
    if not os.path.isdir(run_dir):
        raise ProfileError(f"{run_dir}: no such run directory")
    records = [r for r in read_records(run_dir) if all(k in r for k in KEYS)][skip_first:]
    if not records:
        raise ProfileError(f"{run_dir}: no GRPO step records ({', '.join(KEYS)}) in its {METRICS_FILE}")
    config = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config):
        raise ProfileError(f"{run_dir}: no config.yaml: the system prompt's tokens need the run's domain")
    system, firsts, overhead = prompt_tokens(config)
    shapes, conversations = None, os.path.join(run_dir, SFT_FILE)
    if os.path.isfile(conversations):
        from muajax.models.tokenizer import load_tokenizer
        shapes = message_tokens(conversations, load_tokenizer())
        if not all(shapes.values()):
            shapes = None
    agent, resp, seq = (_mean(records, k) for k in ("assistant_turns", "response_tokens", "sequence_tokens"))
    latency = [float(r["user_latency_s"]) for r in records if "user_latency_s" in r]
    tool_calls = statistics.fmean(sum(v for k, v in r.items() if k.startswith("calls/")) for r in records)
    where = f"{os.path.abspath(run_dir)}/{METRICS_FILE}, {len(records)} GRPO steps"
    return {
        "name": f"run {os.path.basename(os.path.abspath(run_dir))}", "steps": len(records),
        "draws": int(statistics.median(int(r.get("num_seqs", 0)) for r in records)),
        "system": system, "firsts": firsts, "overhead": overhead, "agent_turns": agent,
        "tool_turns": min(tool_calls, agent), "response_tokens": resp, "sequence_tokens": seq,
        "longest_agent_turns": _longest(records, "assistant_turns"),
        "longest_sequence_tokens": _longest(records, "sequence_tokens"),
        "user_latency_s": statistics.fmean(latency) if latency else 0.0, "shapes": shapes,
        "sources": {
            "agent_turns": f"{where}: assistant_turns (mean of the step means); spread: uniform, its expected "
                           "largest the median step's longest/assistant_turns where logged",
            "tool_turns": f"{where}: calls/* per conversation, one call per tool turn",
            "agent_turn_tokens": f"{where}: response_tokens / assistant_turns" + (
                f"; spread: {conversations}'s assistant messages scaled to that mean" if shapes else ""),
            "tool_result_tokens": f"{where}: sequence_tokens less the prompt, the sampled tokens and the turn "
                                  "template, over the replies" + (
                f"; split between tool results and user replies, and spread, as {conversations}'s are, scaled "
                "to that mean" if shapes else " (tool results and user replies alike)"),
            "user_turn_tokens": "as tool_result_tokens",
            "user_latency_s": f"{where}: user_latency_s",
            "sequence_tokens": f"{where}: sequence_tokens; spread from longest/sequence_tokens where logged",
            "system_tokens": f"{config}: the domain's system prompt and tools, Qwen3 tokenizer",
            "first_user_tokens": f"{config}: the training tasks' first user messages, Qwen3 chat template"}}
