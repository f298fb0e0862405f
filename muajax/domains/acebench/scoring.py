"""ACEBench Agent scoring, as ACEBench's `eval_main.agent_eval`, `agent_eval_process` and
`model_eval.checker.agent_checker` compute it.

End-to-end accuracy (the reward): the sandbox's final state, one `{class: {attribute: value}}`
per involved class (the attributes its `SAVED_CLASS` lists), passed through JSON as ACEBench's
result file passes it (integer keys become strings), compared with `ground_truth`:
- the number of classes must match (ACEBench records no state before a call ran: in multi-turn,
  a message whose calls all ran; in multi-step, any well-formed call);
- each ground-truth class is matched to the state entry with the same class name; one that
  matches none is not checked (ACEBench's loop keeps the previous verdict; its data has such
  typos, e.g. "ReminderAPI"): `unchecked` lists them;
- in a matched class every recorded attribute must be in the ground truth; a dict attribute
  must hold every key the ground truth gives, with an equal value (keys only the sandbox has
  are not checked, as in ACEBench); any other attribute must be equal.

Process accuracy (the partial score): the milestones (`mile_stone`, one call message each,
or several lists of them: alternatives, the best counts) found in order in the agent's call
messages, as a share; 1 when the end state is right. ACEBench compares message strings; the
agent here calls tools with JSON arguments, so a milestone matches a message with the same
calls (names and argument values, in order), whatever the argument order or quoting. A
milestone that is not Python as written gets one repair (an apostrophe between letters inside
a single-quoted string, e.g. 'Domino's', is escaped); one that still does not parse is
compared as text with the message rendered the way ACEBench's executor writes calls.
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from muajax.domains.base import ToolCall

_APOSTROPHE = re.compile(r"(?<=\w)'(?=\w)")
REPAIRED = "repaired: an apostrophe inside a single-quoted string was escaped"


def render_call(call: ToolCall) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
    return f"{call.name}({args})"


def render_message(calls: Sequence[ToolCall]) -> str:
    """One call message as ACEBench's agent writes it: `[name(k='v', ...), ...]`."""
    return "[" + ", ".join(render_call(c) for c in calls) + "]"


def _calls_of(text: str) -> list[ToolCall]:
    body = ast.parse(text.strip(), mode="eval").body
    nodes = body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError(f"not a call with keyword arguments: {ast.unparse(node)[:80]}")
        calls.append(ToolCall(node.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}))
    return calls


def parse_milestone(text: str) -> tuple[list[ToolCall] | None, str | None]:
    """(its calls, a note) — calls None when it does not parse even after the repair."""
    try:
        return _calls_of(text), None
    except (SyntaxError, ValueError):
        pass
    try:
        return _calls_of(_APOSTROPHE.sub(r"\\'", text)), REPAIRED
    except (SyntaxError, ValueError) as exc:
        return None, f"not a Python call: {type(exc).__name__}: {exc}"


def alternatives(mile_stone: Sequence[Any]) -> list[list[str]]:
    """The milestone sequences: one, or several when ACEBench gives a list of lists."""
    if mile_stone and all(isinstance(m, list) for m in mile_stone):
        return [list(m) for m in mile_stone]
    return [list(mile_stone)]


def _same(stone: str, message: Sequence[ToolCall]) -> bool:
    calls, _ = parse_milestone(stone)
    if calls is None:
        return stone.strip() == render_message(message).strip()
    return len(calls) == len(message) and all(
        a.name == b.name and a.arguments == b.arguments for a, b in zip(calls, message))


def _ordered_share(stones: Sequence[str], messages: Sequence[Sequence[ToolCall]]) -> float:
    if not stones:
        return 1.0
    hits, i = 0, 0
    for stone in stones:
        while i < len(messages):
            i += 1
            if _same(stone, messages[i - 1]):
                hits += 1
                break
    return hits / len(stones)


def process_accuracy(mile_stone: Sequence[Any], messages: Sequence[Sequence[ToolCall]]) -> float:
    """The best alternative's ordered share of milestones found in `messages`, rounded as ACEBench."""
    return max(round(_ordered_share(stones, messages), 3) for stones in alternatives(mile_stone))


def snapshot(instances: dict[str, Any], saved: dict[str, Sequence[str]]) -> list[dict[str, Any]]:
    """The state ACEBench records: per class its listed attributes, through JSON."""
    state = [{name: {k: v for k, v in vars(obj).items() if k in saved.get(name, ())}} for name, obj in
             instances.items()]
    return json.loads(json.dumps(state, ensure_ascii=False, default=str))


def _class_errors(name: str, model: dict[str, Any], truth: dict[str, Any]) -> list[str]:
    errors = []
    for attr, value in model.items():
        if attr not in truth:
            errors.append(f"{name}.{attr}: not in the ground truth")
        elif isinstance(truth[attr], dict):
            for key, expected in truth[attr].items():
                if not isinstance(value, dict) or key not in value:
                    errors.append(f"{name}.{attr}[{key!r}]: missing, expected {expected!r:.200}")
                elif value[key] != expected:
                    errors.append(f"{name}.{attr}[{key!r}]: expected {expected!r:.200}, got {value[key]!r:.200}")
        elif truth[attr] != value:
            errors.append(f"{name}.{attr}: expected {truth[attr]!r:.200}, got {value!r:.200}")
    return errors


def compare_state(state: list[dict[str, Any]], ground_truth: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(errors, unchecked ground-truth classes); the state is right when errors is empty."""
    if len(state) != len(ground_truth):
        why = "no call ran, so no state was recorded; " if not state else ""
        return [f"wrong number of classes: {why}the ground truth has {len(ground_truth)}, the state {len(state)}"], []
    errors, unchecked = [], []
    for entry in ground_truth:
        match = next((m for m in state if set(m) == set(entry)), None)
        name = next(iter(entry), "?")
        if match is None:
            unchecked.append(name)
            continue
        errors += _class_errors(name, match[name], entry[name])
    return errors, unchecked


def subset_of(task_id: str) -> str | None:
    return next((s for s in ("multi_turn", "multi_step") if s in task_id), None)


LABELS = {"multi_turn": "Multi-turn", "multi_step": "Multi-step"}


def subset_figures(records: Iterable[Any]) -> dict[str, Any]:
    """Per subset, over its rollouts (anything with task_id, reward, partial): items, rollouts,
    end-to-end and process accuracy; `overall`: the unweighted mean over the subsets present
    (the paper's Agent "Overall" is the end-to-end one)."""
    groups: dict[str, list[Any]] = {}
    for r in records:
        groups.setdefault(subset_of(r.task_id) or "other", []).append(r)
    out: dict[str, Any] = {}
    for subset, rs in groups.items():
        out[subset] = {"label": LABELS.get(subset, subset), "items": len({r.task_id for r in rs}), "rollouts": len(rs),
                       "end_to_end": sum(float(r.reward) >= 1.0 for r in rs) / len(rs),
                       "process": sum(float(r.partial) for r in rs) / len(rs)}
    present = [out[s] for s in LABELS if s in out]
    if present:
        out["overall"] = {"label": "Overall", "end_to_end": sum(p["end_to_end"] for p in present) / len(present),
                          "process": sum(p["process"] for p in present) / len(present)}
    return out


def gold_failures(replays: Iterable[Any]) -> dict[str, str]:
    """Why each replay below 1 missed the ground truth (its state errors, then milestone notes)."""
    out = {}
    for r in replays:
        if float(r.reward) < 1.0:
            d = r.details or {}
            reasons = list(d.get("state_errors") or [d.get("evaluate_error", "no reason recorded")])[:3]
            out[r.task_id] = "; ".join(reasons + list(d.get("milestone_notes") or []))
    return out


def format_figures(figures: dict[str, Any]) -> list[str]:
    language = figures.get("language", "en")
    title = (f"ACEBench Agent ({language}): end-to-end accuracy (final state = ground truth), process accuracy "
             "(milestones in order)")
    lines = [title]
    for key in (*LABELS, "other"):
        if key in figures:
            f = figures[key]
            lines.append(f"  {f['label']:<11} {f['items']:>3} items, {f['rollouts']:>4} rollouts: end-to-end "
                         f"{f['end_to_end']:.4f}  process {f['process']:.4f}")
    if "overall" in figures:
        f = figures["overall"]
        lines.append(f"  Overall (unweighted mean of the subsets): end-to-end {f['end_to_end']:.4f}  "
                     f"process {f['process']:.4f}")
    for task_id, reason in (figures.get("failures") or {}).items():
        lines.append(f"  gold misses the ground truth: {task_id}: {reason[:300]}")
    return lines
