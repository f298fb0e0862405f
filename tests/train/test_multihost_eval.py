"""The held-out evaluation split across processes (`muajax.train.trainer.evaluate`): each
process rolls out its share of the tasks, the report is of them all and equals a one-process
evaluation's."""
import json

from muajax.runtime.distributed import evaluation_share
from tests.support.tiny_models import arch_override
from tests.train.test_multihost import finish, free_port, launch

# One SFT step of a tiny random model, then an evaluation of 3 held-out tasks x 2 sampled
# trials: an uneven split (1 and 2 tasks), and sampling, so that every conversation's seed
# must be the one-process evaluation's for the transcripts to agree.
TINY_SFT_EVAL = [
    "run.stages=[sft]", "model.hf_dir=null", arch_override(), "model.vocab=domain", "sft.steps=1", "sft.batch_size=2",
    "sft.max_len=1024", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=12", "rollout.max_context=1024",
    "eval.max_tasks=3", "eval.temperature=1.0", "eval.trials=2", "checkpoint.every_steps=1",
    "metrics.progress_bar=false", "metrics.tensorboard=false",
    # params replicated over two devices in both runs (see test_multihost.TINY_GRPO)
    "mesh.data=2", "mesh.fsdp=1",
]


def test_evaluation_shares_are_contiguous_blocks_that_differ_by_at_most_one_task():
    tasks = list("abcde")
    assert [evaluation_share(tasks, p, 2) for p in range(2)] == [(0, ["a", "b"]), (2, ["c", "d", "e"])]
    assert [evaluation_share(tasks, p, 3) for p in range(3)] == [(0, ["a"]), (1, ["b", "c"]), (3, ["d", "e"])]
    shares = [evaluation_share(tasks[:2], p, 4) for p in range(4)]  # fewer tasks than processes
    assert shares == [(0, []), (0, ["a"]), (1, []), (1, ["b"])]
    assert evaluation_share(tasks, 0, 1) == (0, tasks)


def without_timings(report: dict) -> dict:
    summary = {k: v for k, v in report["summary"].items() if k not in ("wall_s", "conversations_per_process")}
    tasks = [{**{k: v for k, v in task.items() if k != "process"},
              "rollouts": [{k: v for k, v in r.items() if k != "wall_s"} for r in task["rollouts"]]}
             for task in report["tasks"]]
    return {"summary": summary, "tasks": tasks}


def test_two_processes_evaluate_a_share_each_and_report_what_one_process_reports(tmp_path):
    """1 process x 2 devices against 2 processes x 1 device: each of the two rolls out only
    its tasks (1 and 2 of 3), and the one report, written by process 0, is the one-process
    report (summary, per-task records and transcripts), apart from timings and who ran what."""
    port = free_port()
    train = ["-m", "muajax.train", *TINY_SFT_EVAL]
    procs = [launch([*train, f"run.out_dir={tmp_path / 'one'}"], devices=2)]
    procs += [launch([*train, f"run.out_dir={tmp_path / 'two'}"], devices=1, process_id=i, port=port)
              for i in range(2)]
    (_, one_out, _), (_, two_out, _), (_, other_out, _) = finish(procs)
    one, two = json.loads(one_out.strip().splitlines()[-1]), json.loads(two_out.strip().splitlines()[-1])
    assert two["params_sha256"] == one["params_sha256"]
    assert two["heldout_success_sft"] == one["heldout_success_sft"] and two["partial_sft"] == one["partial_sft"]
    assert "split across 2 processes" in two_out and "held-out success" not in other_out  # one report

    def report(name):
        return json.loads((tmp_path / name / "embedded-cpu" / "eval_sft.json").read_text())

    a, b = report("one"), report("two")
    assert a["summary"]["conversations_per_process"] == [6]
    assert b["summary"]["conversations_per_process"] == [2, 4]  # 2 trials of 1 task, of 2 tasks
    assert [t["process"] for t in a["tasks"]] == [0, 0, 0]
    assert [t["process"] for t in b["tasks"]] == [0, 1, 1]
    assert [t["trials"] for t in b["tasks"]] == [2, 2, 2]
    assert without_timings(b) == without_timings(a)
    assert len({json.dumps(r["messages"]) for t in a["tasks"] for r in t["rollouts"]}) > 1  # sampled, not all alike
