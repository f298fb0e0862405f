"""The planner compiles the GRPO step the trainer runs: a tiny run of the embedded default
goes through the trainer, and every GRPO step it builds and calls is captured (the
settings it was made with, the abstract arguments of each call: shapes, dtypes and
shardings of the train state, the batch and the KL reference); the planner's step for the
same config must be made and lowered with the very same ones. With packed rows (the
default, `grpo.pack_rows`) the trainer's batch has as many rows as its trajectories pack
into, one of the layout's row buckets, and the planner compiles the most of them: the
same fields, dtypes and shardings, at the rows of a step whose trajectories do not pack."""
import os

import jax
import pytest

from muajax import parallel
from muajax.config.schema import load_config
from muajax.planning.planner import from_train_config, plan_run
from muajax.planning.run_config import domain_facts, model_from_config
from muajax.rl.step import TrainStep
from muajax.runtime import grpo_layout
from muajax.runtime import build
from muajax.train.context import build_context
from muajax.train.grpo import run_grpo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The embedded default, shortened: one GRPO step of 2 tasks x 4 rollouts in 2 microbatches,
# conversations of up to 2 turns; the KL reference kept in bfloat16.
OVERRIDES = ["run.stages=[grpo]", "grpo.steps=1", "rollout.tasks_per_step=2", "rollout.n_per_task=4",
             "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=8", "grpo.microbatch_size=4",
             "grpo.reference_dtype=bfloat16", "grpo.length_buckets=[1536]", "metrics.progress_bar=false",
             "metrics.tensorboard=false"]


def describe(args, shardings) -> list[tuple]:
    """Each argument leaf's path, shape and dtype, with the sharding the step's jitted
    update takes it in (mesh axes and partition spec)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(args)
    specs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    assert len(specs) == len(leaves)
    return [(jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype), tuple(s.mesh.shape.items()), tuple(s.spec))
            for (path, x), s in zip(leaves, specs)]


class Capture:
    """Records how GRPO steps are made (`grpo_layout.make_grpo_step`) and the arguments each
    is called (trainer) or lowered (planner) with (`TrainStep._args`, which both go through)."""

    def __init__(self, monkeypatch):
        self.made, self.calls = [], []
        make, args_of = grpo_layout.make_grpo_step, TrainStep._args

        def making(cfg, optimizer, mesh, **settings):
            self.made.append({"model": cfg, "mesh": tuple(mesh.shape.items()), **settings})
            return make(cfg, optimizer, mesh, **settings)

        def arguments(step, state, batch, frozen):
            fn, args = args_of(step, state, batch, frozen)
            shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), state.params)
            shardings = (step.state_shardings(shapes), step.batch_shardings(batch))
            shardings += (step.frozen_shardings,) if frozen is not None else ()
            self.calls.append(describe(args, shardings))
            return fn, args

        monkeypatch.setattr(grpo_layout, "make_grpo_step", making)
        monkeypatch.setattr(TrainStep, "_args", arguments)


def trainer_side(cfg, monkeypatch) -> Capture:
    captured = Capture(monkeypatch)
    ctx = build_context(cfg)
    run_grpo(ctx, build.initial_params(ctx.model_cfg, ctx.hf_dir, ctx.mesh, cfg.run.seed))
    return captured


def planner_side(cfg, monkeypatch) -> Capture:
    captured = Capture(monkeypatch)
    model, _, _ = model_from_config(cfg)
    facts = domain_facts(cfg)
    settings = from_train_config(cfg, prompt_prefix=facts.prompt_prefix, eval_slots=facts.eval_conversations,
                                 phases=("update",))
    devices = jax.devices()
    sizes = dict(zip(parallel.MESH_AXES, parallel.resolve_mesh_shape(*cfg.mesh.sizes().values(), len(devices))))
    plan = plan_run(model, devices=devices, mesh=sizes, settings=settings, label="embedded")
    assert plan.rows["grpo"]["shared_prefix"] == captured.made[0]["shared_prefix"]
    return captured


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    cfg = load_config(os.path.join(ROOT, "configs", "embedded-cpu.yaml"),
                      [*OVERRIDES, f"run.out_dir={tmp_path_factory.mktemp('run')}"])
    with pytest.MonkeyPatch.context() as mp:
        trainer = trainer_side(cfg, mp)
    with pytest.MonkeyPatch.context() as mp:
        planner = planner_side(cfg, mp)
    return trainer, planner


def test_the_planner_makes_the_step_the_trainer_makes(sides):
    trainer, planner = sides
    assert len(trainer.made) == len(planner.made) == 1
    made = trainer.made[0]
    # the embedded domain's 861-token system prompt, shared on a CPU (chunked attention either
    # way), once per packed row; segment ids up to the 8 trajectories of the update
    assert made["shared_prefix"] > 128 and made["microbatches"] == 2 and made["segments"] == 9
    assert planner.made == trainer.made


def batch_rows(call) -> tuple[set[int], list]:
    """The batch's row counts, and the call with them taken out of the batch's shapes."""
    rows = {shape[0] for path, shape, *_ in call if path.startswith("[1]")}
    return rows, [(path, shape[1:] if path.startswith("[1]") else shape, *rest) for path, shape, *rest in call]


def test_the_planner_compiles_the_arguments_the_trainer_passes(sides):
    trainer, planner = sides
    assert len(trainer.calls) == 1 and len(planner.calls) == 1
    args = {path: (shape, dtype) for path, shape, dtype, _, _ in trainer.calls[0]}
    assert args["[1]['tokens']"][1] == "int32" and args["[1]['tokens']"][0][1] == 1536  # the one bucket
    assert args["[1]['segment_ids']"][0] == args["[1]['tokens']"][0]  # packed rows
    assert {dtype for path, (_, dtype) in args.items() if path.startswith("[2]")} == {"bfloat16"}  # the reference
    (ran,), ran_call = batch_rows(trainer.calls[0])
    (planned,), planned_call = batch_rows(planner.calls[0])
    # the 8 rollouts (a ~150-token conversation after the prompt each) pack into fewer rows;
    # the planner compiles the most, 8, and every other leaf as the trainer passes it
    assert ran < planned == 8 and ran % 2 == 0
    assert planned_call == ran_call
