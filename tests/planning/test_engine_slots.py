"""The planner sizes each host's engine as the trainer does (`RunContext.engine_slots`): a
host's share of a step's conversations, or of the evaluation's when more, split by
`muajax.runtime.distributed.evaluation_share`."""
import pytest

from muajax.config.schema import load_config
from muajax.planning.planner import from_train_config
from muajax.runtime import run_tasks


class Env:
    def __init__(self, test: int):
        self.test = test

    def tasks(self, split):
        return [object()] * (self.test if split == "test" else 10)


@pytest.mark.parametrize("overrides", [["eval.temperature=1.0", "eval.trials=3"], ["eval.temperature=0"],
                                       ["eval.temperature=1.0", "eval.trials=4", "rollout.num_slots=6"]])
@pytest.mark.parametrize("held_out", [5, 60])
def test_the_planner_gives_each_host_the_engine_slots_the_trainer_gives_it(overrides, held_out):
    cfg = load_config(None, ["rollout.n_per_task=4", "rollout.tasks_per_step=4", *overrides])
    env = Env(held_out)
    eval_slots = 0 if cfg.rollout.num_slots is not None else run_tasks.eval_conversations(cfg, env)  # domain_facts
    engine = from_train_config(cfg, eval_slots=eval_slots).engine_settings
    for hosts in (1, 2, 3, 4, 7, 16):
        assert engine.host_slots(hosts) == run_tasks.engine_slots(cfg, env, hosts), hosts
