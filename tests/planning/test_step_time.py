"""The GRPO step-time model: the rollout's schedule, each call priced from compiled costs,
the weight sync and the update, on hand-built ProgramCosts (no compiler)."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from muajax.agent.rollout_config import RolloutConfig
from muajax.planning.calibration import measured, step_settings
from muajax.planning.compile import ProgramCost
from muajax.planning.phases import Part, Phase
from muajax.planning.programs import EngineSettings
from muajax.planning.rollout_profile import Distribution, RolloutProfile
from muajax.planning.rollout_schedule import CallTimes, Conversation, Schedule, extend_calls, simulate
from muajax.planning.step_time import Rates, predict_step, update_seconds
from muajax.rl.grpo import GRPOConfig
from tests.support.tiny_models import TINY_CONFIG

RATES = Rates("test", peak_flops=1e12, mem_bytes_per_s=1e11, dispatch_s=1e-3, overlap=True)


def _cost(name: str, flops: float, bytes_: float) -> ProgramCost:
    return ProgramCost(name, "cpu", {}, {}, flops=flops, bytes_accessed=bytes_)


def _plan(copy_bytes: int = 0, grpo: GRPOConfig | None = None, batch: int = 8, max_len: int = 1024):
    engine = EngineSettings(num_slots=batch, max_len=max_len)
    programs = [_cost("engine decode", 2e9, 1e9), _cost("grpo step", 4e12, 1e11)]
    programs += [_cost(f"engine extend_{w}", 1e9 * w / 32, 5e8) for w in (32, 128, 512, 1024)]
    grpo = grpo or GRPOConfig(kl_coef=0.001)
    settings = types.SimpleNamespace(engine_settings=engine, batch=batch, seq=max_len, grpo=grpo)
    rows = {"grpo": {"batch": grpo.minibatch_size or batch, "microbatches": 1, "length": max_len,
                     "buckets": [512, max_len], "shared_prefix": 0}}
    phases = [Phase("rollout", [Part("engine: params", copy_bytes)])]
    return types.SimpleNamespace(programs=programs, cfg=TINY_CONFIG, settings=settings, devices=1, phases=phases,
                                 mesh={"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1},
                                 rows=rows, compiler="cpu", chip=None)


def _profile(turns: float, **overrides) -> RolloutProfile:
    values = dict(name="hand", system_tokens=100, first_user_tokens=Distribution(20.0),
                  agent_turns=Distribution(turns), tool_turns=Distribution(turns / 2),
                  agent_turn_tokens=Distribution(32.0), user_turn_tokens=Distribution(10.0),
                  tool_result_tokens=Distribution(10.0), user_latency_s=Distribution(0.0),
                  sequence_tokens=Distribution(400.0), turn_overhead_tokens=0)
    return RolloutProfile(**{**values, **overrides})


def _rollout(**overrides) -> RolloutConfig:
    return RolloutConfig(**{"max_context": 1024, "max_new_tokens_per_turn": 64, "max_turns": 64, **overrides})


def test_a_call_is_dispatch_plus_the_roofline_max_or_on_a_cpu_the_sum():
    assert RATES.seconds(2e12, 1e11) == pytest.approx(1e-3 + 2.0)
    serial = Rates("cpu", 1e12, 1e11, dispatch_s=0.0, overlap=False)
    assert serial.seconds(2e12, 1e11) == pytest.approx(3.0)
    # on a CPU the temporaries a call allocates are faulted in at the fresh-write rate; a chip keeps them
    cpu = Rates("cpu", 1e12, 1e11, dispatch_s=0.0, overlap=False, fresh_bytes_per_s=1e9)
    assert cpu.seconds(2e12, 1e11, fresh_bytes=5e8) == pytest.approx(3.5)
    assert RATES.seconds(2e12, 1e11, fresh_bytes=5e8) == RATES.seconds(2e12, 1e11)


def test_doubling_the_turns_doubles_the_decode_calls_and_time():
    schedule = Schedule(conversations=4, num_slots=4, max_context=4096, max_new_tokens=64, max_turns=100,
                        decode_chunk=16, dense_buckets=False)
    times = CallTimes(decode=lambda rows, keys, steps, computed, reading: 0.5, extend=lambda rows, width, keys, computed: 0.0)

    def decode_s(turns):
        convs = [Conversation(50, [32] * turns, [10] * (turns - 1), [0.0] * (turns - 1)) for _ in range(4)]
        return simulate(convs, schedule, times)

    one, two = decode_s(5), decode_s(10)
    assert one.decode_calls == 5 * 2  # two chunks of 16 per 32-token turn, the four conversations in step
    assert two.decode_calls == 2 * one.decode_calls and two.decode_s == pytest.approx(2 * one.decode_s)
    assert one.sampled_tokens == 4 * 5 * 32


def test_a_reply_joins_the_step_after_next_while_others_decode_and_latency_overlaps():
    schedule = Schedule(conversations=2, num_slots=2, max_context=4096, max_new_tokens=256, max_turns=100,
                        decode_chunk=16, dense_buckets=False)
    rows = []
    times = CallTimes(decode=lambda r, keys, steps, computed, reading: rows.append(r) or 1.0, extend=lambda *call: 0.0)
    short = Conversation(10, [16, 16], [5], [0.0])  # one chunk per turn
    long = Conversation(10, [160], [], [])            # ten chunks
    run = simulate([short, long], schedule, times)
    # the short one's reply is posted during step 1, so its second turn decodes in step 2
    assert rows == [2, 1, 2, 1, 1, 1, 1, 1, 1, 1] and run.steps == 10
    assert sorted(run.lengths) == [10 + 16 + 5 + 16, 10 + 160]
    alone = simulate([Conversation(10, [16, 16], [5], [3.0])], schedule, times)
    assert alone.steps == 2 and alone.wait_s == pytest.approx(3.0) and alone.seconds == pytest.approx(2.0 + 3.0)
    # while the long one decodes, the 3 s of latency pass under its steps
    rows.clear()
    both = simulate([Conversation(10, [16, 16], [5], [3.0]), long], schedule, times)
    assert both.wait_s == 0.0 and both.seconds == pytest.approx(10.0) and rows[:5] == [2, 1, 1, 1, 2]


def test_fixed_rows_extend_each_conversation_at_its_own_width_every_slot_computed():
    fixed = Schedule(conversations=4, num_slots=4, max_context=4096, max_new_tokens=64, max_turns=10, call_rows=4,
                     widths=(32, 128, 512), max_extend_tokens=1024)
    calls = extend_calls([(0, 20), (0, 100), (0, 30)], fixed)
    assert calls == [(4, 32, 30, 4), (4, 128, 100, 4)]  # (rows, width, keys, rows computed)
    # a prompt wider than the widest width: in chunks of it, each over the keys it reaches (no dense bucket)
    assert extend_calls([(0, 1100)], fixed) == [(2, 512, 512, 2), (2, 512, 1024, 2), (4, 128, 1100, 4)]


def test_packed_extends_cut_every_waiting_token_into_tiles_and_token_tiles_compute_the_live_ones():
    shape = dict(conversations=4, num_slots=4, max_context=4096, max_new_tokens=64, max_turns=10,
                 max_extend_tokens=1024)
    todo = [(0, 20), (0, 100), (0, 30)]  # 2 + 7 + 2 = 11 tiles of 16, in one call of 16 rows
    packed = extend_calls(todo, Schedule(**shape))
    assert packed == [(16, 16, 100, 16)]  # whole-call dots: every row, each over the longest row's keys
    tiled = extend_calls(todo, Schedule(**shape, tiled=True))
    reach = [16, 20, 16, 32, 48, 64, 80, 96, 100, 16, 30]
    assert tiled == [(16, 16, -(-sum(reach) // 11), 11)]  # the live rows, each over its own keys
    # 1100 tokens are 69 tiles: a call of every row a call holds (64), then 5 in a bucket of 8
    assert [(c.rows, c.computed) for c in extend_calls([(0, 1100)], Schedule(**shape, tiled=True))] == [(64, 64),
                                                                                                        (8, 5)]
    # a lone 50-token turn: 4 rows of 16 computed, where fixed rows of 4 compute 4 x 64
    assert extend_calls([(500, 50)], Schedule(**shape, tiled=True))[0].computed * 16 == 64
    fixed = extend_calls([(500, 50)], Schedule(**shape, call_rows=4))
    assert fixed[0].computed * fixed[0].width == 4 * 128


def test_a_tiled_decode_computes_the_live_tiles_of_each_step():
    from muajax.planning.rollout_schedule import decode_row_steps

    tiled = Schedule(conversations=8, num_slots=8, max_context=4096, max_new_tokens=64, max_turns=10, tiled=True)
    # 5 rows: 3 run 16 steps, 2 stop after 4; tiles of 4 rows: 8 rows for 4 steps, then 4 for 12
    assert decode_row_steps([16, 16, 16, 4, 4], 8, tiled, 16) == 4 * 8 + 12 * 4
    untiled = Schedule(conversations=8, num_slots=8, max_context=4096, max_new_tokens=64, max_turns=10)
    assert decode_row_steps([16, 16, 16, 4, 4], 8, untiled, 16) == 8 * 16
    # rows per decode call: whole tiles, at least batching.MIN_TILES (batching.decode_buckets)
    assert tiled.row_buckets == (8,)
    seen = []
    times = CallTimes(decode=lambda rows, keys, steps, computed, reading: seen.append((rows, steps, computed)) or 0.1,
                      extend=lambda *call: 0.0)
    run = simulate([Conversation(10, [40], [], []) for _ in range(5)], tiled, times)
    assert seen[0] == (8, 16, 8 * 16) and run.decode_positions == sum(c for _, _, c in seen)
    assert run.decode_positions / run.sampled_tokens == pytest.approx(8 / 5)


def test_predict_step_prices_the_compiled_shapes_and_scales_the_turns():
    plan = _plan()
    settings = step_settings(plan, _rollout(call_layout="fixed_rows"))
    assert settings.schedule.call_rows == 8 and not settings.schedule.tiled
    short = predict_step(plan, _profile(4.0), RATES, settings, samples=2)
    long = predict_step(plan, _profile(8.0), RATES, settings, samples=2)
    assert long["rollout"]["decode_calls"] == pytest.approx(2 * short["rollout"]["decode_calls"], rel=0.1)
    assert long["rollout_s"] > 1.5 * short["rollout_s"]
    # a decode call of every slot over the whole context is the compiled one
    from muajax.planning.step_time import _EngineModel, extend_program_rows
    programs = {p.name: p for p in plan.programs}
    engine = _EngineModel(programs, plan.cfg, RATES, settings.schedule, 8, extend_program_rows(settings.schedule, 8))
    assert engine.decode(8, 1024, 16) == pytest.approx(RATES.seconds(2e9, 1e9))
    assert engine.decode(8, 1024, 8) < engine.decode(8, 1024, 16)
    assert engine.decode(8, 256, 16) < engine.decode(8, 1024, 16)


def test_an_engine_reading_the_params_in_place_syncs_nothing_and_a_copy_costs_its_bytes():
    profile = _profile(4.0)
    inplace = predict_step(_plan(0), profile, RATES, step_settings(_plan(0), _rollout()), samples=1)
    assert inplace["sync_s"] == 0.0
    copied = predict_step(_plan(10**9), profile, RATES, step_settings(_plan(10**9), _rollout()), samples=1)
    assert copied["sync_s"] == pytest.approx(1e-3 + 2 * 1e9 / 1e11)
    assert copied["step_s"] == pytest.approx(copied["rollout_s"] + copied["sync_s"] + copied["update_s"])


def test_the_update_is_its_program_per_mini_batch_and_epoch_at_the_batch_s_length():
    plan = _plan(grpo=GRPOConfig(kl_coef=0.001, minibatch_size=4, ppo_epochs=2, recompute_old_logprobs=True))
    s = step_settings(plan, _rollout())
    assert (s.updates_per_epoch, s.ppo_epochs, s.recompute) == (2, 2, True)
    grpo = next(p for p in plan.programs if p.name == "grpo step")
    full = update_seconds(grpo, plan.cfg, RATES, s, 1024)
    assert full["calls"] == 4 and full["per_call_s"] == pytest.approx(RATES.seconds(4e12, 1e11))
    assert 0 < full["recompute_s"] < 2 * full["per_call_s"]
    assert full["seconds"] == pytest.approx(4 * full["per_call_s"] + full["recompute_s"])
    assert update_seconds(grpo, plan.cfg, RATES, s, 512)["per_call_s"] < full["per_call_s"]
    # the step's longest row sets the bucket: short conversations update at 512
    short = predict_step(plan, _profile(2.0), RATES, s, samples=1)
    assert short["update"]["length"] == 512 and short["update_mfu"] > 0


def test_packed_grpo_rows_update_at_the_rows_the_lengths_pack_into():
    plan = _plan(batch=16)
    plan.rows["grpo"] = {**plan.rows["grpo"], "packed": True, "row_buckets": [2, 4, 6, 8, 10, 12, 14, 16]}
    packed = step_settings(plan, _rollout())
    assert packed.row_buckets == (2, 4, 6, 8, 10, 12, 14, 16)
    padded = step_settings(_plan(batch=16), _rollout())
    assert padded.row_buckets == ()
    from muajax.planning.step_time import update_rows
    assert update_rows([300] * 16, 1024, padded) == 16
    assert update_rows([300] * 16, 1024, packed) == 6  # three trajectories of 300 a row of 1024: 6 rows
    assert update_rows([600] * 16, 1024, packed) == 16  # one a row
    # with several hosts each packs its own share and all take the most
    assert update_rows([300] * 8, 1024, step_settings(plan, _rollout(), hosts=2)) == 6
    profile = _profile(2.0)  # conversations of about 190 tokens: two a row of 512
    a = predict_step(plan, profile, RATES, packed, samples=1)
    b = predict_step(_plan(batch=16), profile, RATES, padded, samples=1)
    assert a["update"]["rows"] < 16 == b["update"]["rows"] and a["update"]["length"] == b["update"]["length"]
    assert a["update_s"] < b["update_s"] and a["rollout_s"] == b["rollout_s"]


def test_a_rollout_only_plan_predicts_the_rollout_and_no_update():
    plan = _plan()
    plan.programs = [p for p in plan.programs if p.name != "grpo step"]  # --phases rollout
    p = predict_step(plan, _profile(2.0), RATES, step_settings(plan, _rollout()), samples=1)
    assert p["rollout_s"] > 0 and p["update_s"] == 0.0 and p["step_s"] == p["rollout_s"] + p["sync_s"]
    from muajax.planning.report import summary_lines
    assert "update: not planned" in "\n".join(summary_lines(p))


def test_measured_takes_the_medians_of_a_run(tmp_path):
    records = [{"step": i, "time/rollout_s": r, "time/update_s": u, "perf/update_s": u - 1}
               for i, (r, u) in enumerate([(10.0, 9.0), (12.0, 3.0), (11.0, 4.0)], 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    seen = measured(str(tmp_path))
    assert seen == {"steps": 3, "time/rollout_s": 11.0, "time/update_s": 4.0, "perf/update_s": 3.0}
    assert np.isfinite(seen["time/rollout_s"])


def test_the_useful_flops_are_counted_as_the_trainer_counts_its_mfu():
    from muajax.planning.step_time import useful_flops
    from muajax.models.flops import real_token_flops

    plan = _plan(grpo=GRPOConfig(kl_coef=0.001, minibatch_size=4, ppo_epochs=2, recompute_old_logprobs=True))
    s = step_settings(plan, _rollout())
    lengths = [300, 500, 700, 900]
    for prefix in (0, 200):
        s2 = type(s)(**{**s.__dict__, "shared_prefix": prefix})
        passes = 4.0 * 2 + 1.0
        want = real_token_flops(TINY_CONFIG, lengths, passes=passes, shared_prefix=prefix,
                                prefix_runs=s.updates_per_epoch * s.microbatches)
        assert useful_flops(TINY_CONFIG, lengths, s2) == pytest.approx(want)


def test_this_host_s_rates_come_from_microbenchmarks():
    from muajax.planning.host_rates import measure_host_rates

    rates = measure_host_rates(devices=2)
    assert rates.peak_flops > 1e8 and rates.mem_bytes_per_s > 1e8 and 0 < rates.dispatch_s < 0.1
    assert 1e8 < rates.fresh_bytes_per_s
    assert not rates.overlap and "measured here" in rates.source


def test_an_update_whose_loops_the_hlo_does_not_count_is_scaled_to_the_model_s_executed_flops():
    plan = _plan()
    s = step_settings(plan, _rollout())
    counted = _cost("grpo step", 1e12, 1e11)
    uncounted = ProgramCost("grpo step", "cpu", {}, {}, flops=1e12, bytes_accessed=1e11,
                            loops=[{"computation": "attention", "trips": None, "runs": 8.0}])
    s2 = type(s)(**{**s.__dict__, "executed_flops": 3e12})
    assert update_seconds(counted, plan.cfg, RATES, s2, 1024)["per_call_s"] == pytest.approx(RATES.seconds(1e12, 1e11))
    assert update_seconds(uncounted, plan.cfg, RATES, s2, 1024)["per_call_s"] == pytest.approx(
        RATES.seconds(3e12, 3e11))


def test_the_engine_s_shards_follow_the_mesh_it_decodes_on():
    from muajax.agent.rollout_config import RolloutMeshConfig
    from muajax.chips import get_chip
    from muajax.planning.calibration import engine_shards

    cpu = _plan()
    cpu.mesh, cpu.devices = {"data": 2, "fsdp": 2, "tensor": 1, "sequence": 1}, 4
    assert engine_shards(cpu, _rollout(), hosts=1) == 4  # a CPU engine decodes on the training mesh
    tpu = _plan()
    tpu.chip, tpu.compiler, tpu.devices = get_chip("v5p"), "tpu", 16
    # a host's 8 devices, tensor parallel as wide as the 2 kv heads split: 4 batch shards per host
    assert engine_shards(tpu, _rollout(), hosts=2) == 4
    assert engine_shards(tpu, _rollout(mesh=RolloutMeshConfig(data=1, fsdp=-1, tensor=1)), hosts=2) == 8
    s = step_settings(tpu, _rollout(), hosts=2)
    assert s.schedule.conversations == 4 and s.schedule.shards == 4 and s.schedule.page_size == 128


def test_a_token_tiled_call_reads_the_weights_once_per_live_tile_and_the_plan_reports_computed_over_real():
    from muajax.planning.step_time import _EngineModel, extend_program_rows

    plan = _plan()
    settings = step_settings(plan, _rollout())  # the default: packed calls, token tiles
    assert settings.schedule.tiled and settings.schedule.call_rows is None
    programs = {p.name: p for p in plan.programs}
    engine = _EngineModel(programs, plan.cfg, RATES, settings.schedule, 8, extend_program_rows(settings.schedule, 8))
    weights = engine.weights  # one device: the whole model a pass
    one, two = (engine.extend(16, 16, 16, n) - RATES.dispatch_s for n in (1, 2))
    assert one >= weights / RATES.mem_bytes_per_s and two == pytest.approx(2 * one, rel=0.01)
    # a decode call costs its live tiles' row-steps: half the tiles, about half the time
    full, half = (engine.decode(8, 256, 16, n) - RATES.dispatch_s for n in (8 * 16, 4 * 16))
    assert half == pytest.approx(full / 2, rel=0.05)
    # a tile's padding rows (no conversation) compute but read no keys: the keys' bytes go
    # with the conversations' row-steps alone
    kv = 16 * 256 * engine.kv_token / RATES.mem_bytes_per_s  # one row's keys over 16 steps
    assert full - (engine.decode(8, 256, 16, 8 * 16, 4 * 16) - RATES.dispatch_s) == pytest.approx(4 * kv, rel=0.01)
    profile = _profile(4.0, user_turn_tokens=Distribution(50.0), tool_result_tokens=Distribution(300.0))
    packed = predict_step(plan, profile, RATES, settings, samples=2)
    fixed = predict_step(plan, profile, RATES, step_settings(plan, _rollout(call_layout="fixed_rows")), samples=2)
    p, f = packed["rollout"], fixed["rollout"]
    assert (p["layout"], f["layout"]) == ("packed, token tiles", "fixed_rows")
    assert 1.0 <= p["extend_computed_over_real"] < 1.2 < 2 < f["extend_computed_over_real"]
    assert 1.0 <= p["decode_computed_over_real"] <= f["decode_computed_over_real"]


def test_the_engine_settings_follow_the_config_s_call_layout_and_a_gpu_reads_pages_in_place():
    import dataclasses

    from muajax.config.schema import TrainConfig
    from muajax.planning.calibration import engine_attention
    from muajax.planning.planner import from_train_config

    cfg = TrainConfig()
    packed = from_train_config(cfg).engine_settings
    assert packed.deterministic and packed.call_rows is None and packed.call_layout == "packed"
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, call_layout="fixed_rows"))
    fixed = from_train_config(cfg).engine_settings
    assert not fixed.deterministic and fixed.call_rows == cfg.rollout.n_per_task * cfg.rollout.tasks_per_step
    plan = _plan()
    assert engine_attention(plan) == "reference"
    assert step_settings(plan, _rollout(deterministic=False)).schedule.dense_buckets  # the CPU's dense decode
    plan.settings.engine_settings = dataclasses.replace(plan.settings.engine_settings, platform="gpu")
    assert engine_attention(plan) == "paged"  # an h100 plan compiled by XLA:CPU: no dense decode
    assert not step_settings(plan, _rollout(deterministic=False)).schedule.dense_buckets


def test_a_mixture_of_experts_pass_reads_only_the_experts_its_tokens_are_routed_to():
    from muajax.models.flops import expert_params, weight_read_share
    from muajax.planning.step_time import _EngineModel, extend_program_rows

    plan = _plan()
    plan.cfg = TINY_CONFIG.replace(num_experts=64, num_experts_per_tok=2, moe_intermediate_size=32)
    experts = expert_params(plan.cfg) / plan.cfg.num_params()
    assert experts > 0.5 and weight_read_share(TINY_CONFIG, 1) == 1.0
    assert weight_read_share(plan.cfg, 1) == pytest.approx(1 - experts * (1 - 2 / 64))
    assert weight_read_share(plan.cfg, 10_000) == pytest.approx(1.0)
    settings = step_settings(plan, _rollout())  # token tiles: each pass priced by the model
    programs = {p.name: p for p in plan.programs}
    engine = _EngineModel(programs, plan.cfg, RATES, settings.schedule, 8, extend_program_rows(settings.schedule, 8))
    tile = settings.schedule.decode_tile
    one_tile = engine.decode(tile, 16, 1, tile) - RATES.dispatch_s  # one step of one tile's rows
    assert one_tile * RATES.mem_bytes_per_s == pytest.approx(
        engine.device_weights * weight_read_share(plan.cfg, tile) + tile * 16 * engine.kv_token, rel=1e-6)
    assert weight_read_share(plan.cfg, tile) < 0.9  # a few rows read a few experts
