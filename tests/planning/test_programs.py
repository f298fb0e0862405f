"""The engine's programs on a multi-host slice compile for one host's chips: on v6e-16 a host's
4 chips are ids 0, 1, 4, 5, which libtpu compiles for only renumbered as a slice of their own."""
import pytest

from muajax import parallel
from muajax.planning.topology import libtpu_available

pytestmark = pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed: "
                                'pip install -e ".[tpu]" to run the TPU planning tests')

from muajax.planning.compile import compile_program  # noqa: E402
from muajax.planning.programs import EngineSettings, engine_programs  # noqa: E402
from muajax.planning.topology import parse_topology, tpu_devices  # noqa: E402
from muajax.rl.step import model_abstract_params  # noqa: E402
from muajax.models.sharding import param_shardings  # noqa: E402
from tests.support.tiny_models import TINY_CONFIG  # noqa: E402

# 4 kv heads: the engine's default mesh is tensor=4 over the host's 4 chips (as Qwen3's 8 kv heads are)
TINY = TINY_CONFIG.replace(num_heads=4, num_kv_heads=4, head_dim=128, max_position_embeddings=512, dtype="bfloat16",
                           param_dtype="float32")


def test_the_engine_compiles_for_one_v6e_host_of_a_v6e_16():
    import jax

    devices = tpu_devices(parse_topology("v6e-16"))
    mesh = parallel.make_mesh(1, 16, 1, 1, devices=devices)
    params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                          model_abstract_params(TINY), param_shardings(TINY, mesh))
    programs, state, copy_bytes = engine_programs(TINY, mesh, params,
                                                  EngineSettings(num_slots=16, max_len=128, widths=(32,)))
    # packed extends (the trainer's default): one program, at the most rows of 128 tokens (a TPU's tile) a call holds
    assert copy_bytes > 0 and [p.name for p in programs] == ["engine decode", "engine extend_128x64"]
    fixed, _, _ = engine_programs(TINY, mesh, params, EngineSettings(num_slots=16, max_len=128, widths=(32,),
                                                                     call_rows=16, deterministic=False))
    assert [p.name for p in fixed] == ["engine decode", "engine extend_32"]  # rollout.call_layout fixed_rows
    (pool,) = state  # 4 hosts: each holds a quarter of the slots' pool, on a 4-chip mesh
    assert "per host" in pool and "mesh 1x1x4x1" in pool
    for program in programs:
        cost = compile_program(program, platform="tpu")
        assert cost.error is None and cost.compiler == "tpu" and cost.memory["temporaries"] > 0
