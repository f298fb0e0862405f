"""The rollout engine's layout (`muajax.runtime.rollout_engine`): its mesh over one host's
devices and the dtype of its copy, on TPU topology devices (libtpu; nothing is compiled)
and on this process's CPU device."""
import jax
import jax.numpy as jnp
import pytest

from muajax import parallel
from muajax.agent.rollout_config import RolloutMeshConfig
from muajax.planning.programs import engine_copy, host_devices
from muajax.planning.topology import libtpu_available, parse_topology, tpu_devices
from muajax.rl.step import model_abstract_params
from muajax.runtime.rollout_engine import copies_params, engine_mesh
from tests.support.tiny_models import TINY_CONFIG

needs_libtpu = pytest.mark.skipif(not libtpu_available(), reason="libtpu (TPU topology devices) is not installed: "
                                  'pip install -e ".[tpu]"')

CFG = TINY_CONFIG.replace(num_heads=8, num_kv_heads=8, max_position_embeddings=512, dtype="bfloat16", logits_fp32=True)


def shape(mesh) -> dict[str, int]:
    return dict(mesh.shape)


@needs_libtpu
def test_default_engine_mesh_on_a_tpu_host_is_tensor_parallel_over_the_kv_heads():
    devices = tpu_devices(parse_topology("v5p:2x2x1"))  # one host, 4 chips
    train = parallel.make_mesh(1, -1, 1, devices=devices)
    mesh = engine_mesh(None, train, CFG, devices=devices, multiprocess=False)
    assert shape(mesh) == {"data": 1, "fsdp": 1, "tensor": 4, "sequence": 1, "expert": 1}
    two_heads = CFG.replace(num_kv_heads=2)
    mesh = engine_mesh(None, train, two_heads, devices=devices, multiprocess=False)
    assert shape(mesh) == {"data": 2, "fsdp": 1, "tensor": 2, "sequence": 1, "expert": 1}  # data parallel over the rest
    # rollout.mesh: any layout of the host's devices (-1: the rest), never a sequence axis
    mesh = engine_mesh(RolloutMeshConfig(data=2, tensor=-1), train, CFG, devices=devices, multiprocess=False)
    assert shape(mesh) == {"data": 2, "fsdp": 1, "tensor": 2, "sequence": 1, "expert": 1}
    # the training mesh's own shape: the engine shares it
    assert engine_mesh(RolloutMeshConfig(fsdp=4, tensor=1), train, CFG, devices=devices, multiprocess=False) is train


@needs_libtpu
def test_each_host_has_its_own_engine_on_its_own_chips():
    devices = tpu_devices(parse_topology("v5p-16"))  # 8 chips, 2 hosts
    first, hosts = host_devices(devices)
    assert hosts == 2 and len(first) == 4 and {d.process_index for d in first} == {first[0].process_index}
    train = parallel.make_mesh(1, -1, 1, devices=devices)
    mesh = engine_mesh(None, train, CFG, devices=first, multiprocess=True)
    assert set(mesh.devices.flat) == set(first) and shape(mesh)["tensor"] == 4
    assert copies_params(CFG.replace(dtype="float32"), mesh, train, True)  # a replica per host


@needs_libtpu
def test_the_engine_copy_is_in_the_compute_dtype_but_the_fp32_head():
    devices = tpu_devices(parse_topology("v5p:2x2x1"))
    train = parallel.make_mesh(1, -1, 1, devices=devices)
    mesh = engine_mesh(None, train, CFG, devices=devices, multiprocess=False)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model_abstract_params(CFG))
    copy = engine_copy(params, CFG, mesh)
    assert copy["lm_head"].dtype == jnp.float32  # logits_fp32: the head the trainer uses
    assert {x.dtype for k, x in copy.items() if k not in ("lm_head", "layers")} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(copy["layers"])} == {jnp.dtype(jnp.bfloat16)}
    assert all(x.sharding.mesh is mesh for x in jax.tree.leaves(copy))


def test_a_float32_run_on_its_own_mesh_reads_the_live_params():
    train = parallel.make_mesh(1, -1, 1)
    f32 = CFG.replace(dtype="float32")
    mesh = engine_mesh(None, train, f32, devices=list(train.devices.flat), multiprocess=False)
    assert mesh is train and not copies_params(f32, mesh, train, False)
    assert copies_params(CFG, mesh, train, False)  # bfloat16 compute: a half-width copy


def test_the_weight_handoff_copies_into_buffers_of_its_own_and_sets_the_version():
    """Asynchronous GRPO's handoff: `prepare` never returns the params' own buffers (the
    update that follows donates them), even where the engine would read the live params;
    `adopt` swaps them in with their version, and the engine decodes from them after the
    params are gone."""
    import numpy as np

    from muajax.engine.engine import SamplingParams
    from muajax.models.sharding import param_shardings
    from muajax.runtime.rollout_engine import RolloutEngine
    from tests.support.tiny_models import ENGINE_CONFIG, engine_params

    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    params = jax.device_put(engine_params(), param_shardings(ENGINE_CONFIG, mesh))
    engine = RolloutEngine(None, ENGINE_CONFIG, mesh=mesh, train_mesh=mesh, num_slots=1, max_len=64)
    assert not engine.copies and engine.version == 0  # float32 on the training mesh: no copy of its own
    engine.params = params
    want = engine.generate([engine.open([1, 2, 3])], SamplingParams(temperature=0.0, max_new_tokens=4))

    prepared = engine.prepare(params)
    for new, old in zip(jax.tree.leaves(prepared), jax.tree.leaves(params)):
        assert new is not old and np.array_equal(new, old)
        assert new.addressable_shards[0].data.unsafe_buffer_pointer() != old.addressable_shards[0].data.unsafe_buffer_pointer()
    engine.release(0)
    engine.adopt(3, prepared)
    for leaf in jax.tree.leaves(params):
        leaf.delete()  # as the next update's donation does
    assert engine.version == 3 and engine.params is prepared
    got = engine.generate([engine.open([1, 2, 3])], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert got[0].tokens == want[0].tokens
