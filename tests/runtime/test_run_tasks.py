"""How many conversations a run's engine holds at once: a step's share, or the evaluation's
when more, unless rollout.num_slots caps it (the rest queue for a slot)."""
from muajax.config.schema import load_config
from muajax.runtime import run_tasks


class Env:
    def __init__(self, train: int, test: int):
        self.split = {"train": [Task("retail")] * train, "test": [Task("retail")] * test}

    def tasks(self, split):
        return list(self.split[split])


class Task:
    def __init__(self, domain):
        self.domain = domain


def config(*overrides):
    return load_config(None, ["rollout.n_per_task=4", "rollout.tasks_per_step=2", "eval.temperature=1.0",
                              "eval.trials=3", *overrides])


def test_the_engine_holds_a_step_or_the_whole_evaluation():
    env = Env(train=10, test=5)
    assert run_tasks.engine_slots(config(), env, processes=1) == 15  # 3 trials x 5 held-out tasks > 8
    assert run_tasks.engine_slots(config(), env, processes=2) == 9  # 3 trials x its 3 of the 5 held-out tasks > 4
    assert run_tasks.engine_slots(config(), env, processes=5) == 3  # a task each: its 3 trials > the step's 2
    assert run_tasks.engine_slots(config("eval.max_tasks=1"), env, processes=1) == 8  # the step's 8
    assert run_tasks.engine_slots(config("eval.temperature=0"), env, processes=1) == 8  # greedy: one trial


def test_rollout_num_slots_caps_the_engine_and_the_rest_queue():
    env = Env(train=10, test=5)
    assert run_tasks.engine_slots(config("rollout.num_slots=4"), env, processes=1) == 4
    assert run_tasks.engine_slots(config("rollout.num_slots=4"), env, processes=2) == 2


def test_train_tasks_keep_the_first_n_of_each_domain():
    env = Env(train=10, test=5)
    env.split["train"] = [Task("a"), Task("b"), Task("a"), Task("a"), Task("b")]
    kept = run_tasks.train_tasks(config("env.max_train_tasks=2"), env)
    assert [t.domain for t in kept] == ["a", "b", "a", "b"]
