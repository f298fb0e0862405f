"""Reading τ1-bench's task files from a checkout: the format, and the errors that name
`env.tau1_dir` and what was expected."""
from __future__ import annotations

import os
import sys

import pytest

from muajax.domains.tau1.tasks import Tau1Action, Tau1CheckoutError, check_checkout, load_tau1_tasks, tau1_splits
from tests.domains.tau1.checkout import CANCEL, HEADER, RETURN, task_file, write_checkout


def test_the_tasks_load_in_file_order_without_importing_tau_bench(tmp_path):
    root = write_checkout(tmp_path)
    tasks = load_tau1_tasks(root, "retail", "train")
    assert [t.index for t in tasks] == [0, 1] and {t.split for t in tasks} == {"train"}
    cancel, ret = tasks
    assert cancel.user_id == "fatima_anderson_2157" and cancel.instruction.startswith("Your name is Fatima Anderson")
    assert cancel.actions == (Tau1Action("find_user_id_by_name_zip", {"first_name": "Fatima", "last_name": "Anderson",
                                                                      "zip": "32100"}),
                              Tau1Action("cancel_pending_order", {"order_id": "#W2974929",
                                                                  "reason": "no longer needed"}))
    assert cancel.outputs == ("182.03",) and cancel.extra == {"annotator": "fixture"}
    assert ret.actions[0].kwargs["item_ids"] == ["6777246137"] and ret.outputs == () and ret.extra == {}
    assert "tau_bench" not in sys.modules  # the file was parsed, never run


def test_each_domain_has_the_splits_tau1_ships():
    assert tau1_splits("retail") == ("train", "dev", "test") and tau1_splits("airline") == ("test",)


def test_a_split_tau1_lacks_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"τ1 airline has no split 'train'; available: test"):
        load_tau1_tasks(write_checkout(tmp_path), "airline", "train")


def test_an_unset_tau1_dir_names_the_variable_and_the_checkout():
    with pytest.raises(Tau1CheckoutError, match=r"env\.tau1_dir \(--tau1-dir\).*tau1-retail.*"
                                                r"git clone https://github\.com/sierra-research/tau-bench"):
        check_checkout(None, "retail")


def test_a_missing_directory_is_named(tmp_path):
    missing = os.path.join(tmp_path, "nowhere")
    with pytest.raises(Tau1CheckoutError, match=rf"env\.tau1_dir \(--tau1-dir\): {missing} is not a directory; "
                                                r"expected a checkout of sierra-research/tau-bench"):
        check_checkout(missing, "retail")


def test_a_directory_of_another_layout_names_the_files_it_lacks(tmp_path):
    (tmp_path / "tau_bench").mkdir()
    with pytest.raises(Tau1CheckoutError, match=r"is not a tau-bench checkout of the expected layout: it lacks "
                                                r"tau_bench/envs/retail/tasks_train\.py, .*tasks_test\.py"):
        check_checkout(tmp_path, "retail")
    # airline needs only its own test file
    write_checkout(tmp_path)
    os.remove(tmp_path / "tau_bench/envs/retail/tasks_dev.py")
    assert check_checkout(tmp_path, "airline") == str(tmp_path)
    with pytest.raises(Tau1CheckoutError, match="tasks_dev.py"):
        check_checkout(tmp_path, "retail")


@pytest.mark.parametrize("body, why", [
    ('TASKS_TRAIN = [Task(user_id=os.getenv("U"), instruction="i", actions=[], outputs=[])]\n',
     r"expected a Action\(\.\.\.\) call"),
    ('TASKS_TRAIN = [Task(user_id="u", instruction="i", actions=[], outputs=[x])]\n', "Name is not a literal"),
    ('TASKS_TRAIN = [Task(user_id="u", instruction="i", actions=[])]\n', "task 0 lacks outputs"),
    ('TASKS_TRAIN = [Task(user_id="u", instruction="i", actions=[{"name": "a"}], outputs=[])]\n',
     r"task 0: actions is not a list of Action"),
    ('TASKS_TRAIN = [Task("u")]\n', r"Task\(\.\.\.\) takes keyword arguments only"),
    ('TASKS_TRAIN = list()\n', "TASKS_TRAIN is not a list literal"),
    ('TASKS = []\n', "assigns no TASKS_TRAIN"),
    ('TASKS_TRAIN = [\n', "is not valid Python"),
])
def test_a_file_not_in_tau1s_format_is_refused_with_its_line(tmp_path, body, why):
    root = write_checkout(tmp_path)
    with open(os.path.join(root, "tau_bench/envs/retail/tasks_train.py"), "w") as f:
        f.write(HEADER + body)
    with pytest.raises(Tau1CheckoutError, match=why) as info:
        load_tau1_tasks(root, "retail", "train")
    assert "env.tau1_dir (--tau1-dir)" in str(info.value) and "tasks_train.py" in str(info.value)


def test_nothing_in_a_task_file_runs(tmp_path):
    marker = tmp_path / "ran"
    evil = f'__import__("pathlib").Path({str(marker)!r}).touch()'
    root = write_checkout(tmp_path, train=(CANCEL,))
    path = os.path.join(root, "tau_bench/envs/retail/tasks_train.py")
    with open(path, "w") as f:
        f.write(task_file("TASKS_TRAIN", CANCEL, RETURN).replace('outputs=[],', f'outputs=[{evil}],'))
    with pytest.raises(Tau1CheckoutError, match="is not a literal|expected a Action"):
        load_tau1_tasks(root, "retail", "train")
    assert not marker.exists()
