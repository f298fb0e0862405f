"""Params read to the host a block at a time (`muajax.models.host_blocks`): the fingerprint
keeps its old value (sha256 of every leaf's bytes in tree order) whatever the sharding and
the block size, on one device, 8 devices and two processes; the HF export streams one
tensor at a time and writes what it always wrote."""
import hashlib
import json
import os
import subprocess
import sys
import tracemalloc

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.models import hf, host_blocks
from muajax.models.qwen3 import init_params
from tests.support import workers
from tests.support.tiny_models import TINY_CONFIG
from tests.train.test_multihost import finish, free_port, launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_CONFIG = TINY_CONFIG.replace(tie_word_embeddings=False, num_layers=4)  # sharded_export.CONFIG


def old_fingerprint(params) -> str:
    """params_fingerprint as it was defined: each leaf gathered whole, its bytes hashed in order."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(jax.device_get(leaf)).tobytes())
    return digest.hexdigest()


def reference_tensors(params, cfg, dtype) -> dict:
    """The export's tensors as save_hf computed them before streaming: every leaf on the host."""
    out = {}
    for rule in hf.active_rules(cfg):
        stacked = np.asarray(jax.device_get(hf._path_get(params, rule.param_path)))
        for name, value in zip(hf.hf_names(rule, cfg), stacked if rule.per_layer else [stacked]):
            out[name] = np.ascontiguousarray(rule.to_hf(value, cfg).astype(dtype))
    return out


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (4, 3, 10), (2, 0, 3), (6, 1, 4, 5)])
@pytest.mark.parametrize("block_bytes", [4, 24, 100, 1 << 20])
def test_row_blocks_are_the_c_order_bytes(shape, block_bytes):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    pieces = []
    for starts, sizes in host_blocks.row_blocks(shape, 4, block_bytes):
        assert all(s + n <= d for s, n, d in zip(starts, sizes, shape))
        block = host_blocks.host_block(x, starts, sizes)
        assert block.nbytes <= block_bytes
        pieces.append(block.tobytes())
    assert b"".join(pieces) == x.tobytes()


def test_fingerprint_keeps_its_value_at_any_block_size():
    params = nn.meta.unbox(init_params(TINY_CONFIG, jax.random.key(1)))
    want = old_fingerprint(params)
    assert host_blocks.fingerprint(params) == want
    assert host_blocks.fingerprint(params, block_bytes=64) == want
    from muajax.train.trainer import params_fingerprint
    assert params_fingerprint(params) == want
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert host_blocks.fingerprint(bf16, block_bytes=64) == old_fingerprint(bf16) != want
    changed = dict(params, final_norm=params["final_norm"].at[3].add(1e-6))
    assert host_blocks.fingerprint(changed) != want


def _files(path) -> dict:
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def _single_device_outputs(tmp_path):
    params = nn.meta.unbox(init_params(WORKER_CONFIG, jax.random.key(1)))
    hf.save_hf(params, WORKER_CONFIG, str(tmp_path / "one" / "f32"))
    hf.save_hf(params, WORKER_CONFIG, str(tmp_path / "one" / "bf16"), dtype="bfloat16")
    return params, old_fingerprint(params)


def _result(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])


def test_sharded_on_8_devices_equals_one_device(tmp_path):
    params, want = _single_device_outputs(tmp_path)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, workers.path("sharded_export.py"), str(tmp_path / "eight"), "1,4,2"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _result(proc.stdout)
    assert result["devices"] == 8 and result["fully_addressable"] and result["leaves_split_here"] >= 8
    assert result["paths_agree"]  # the shards' path and the collective path read the same blocks
    assert result["fingerprint"] == result["fingerprint_small_blocks"] == want
    for dtype in ("f32", "bf16"):
        assert _files(tmp_path / "eight" / dtype) == _files(tmp_path / "one" / dtype)


def test_split_across_two_processes_equals_one_device(tmp_path):
    """Leaves split across processes (fsdp 4 x tensor 2 over 2 processes of 4 devices): read
    block by block through the collective path, the same digest and files as one device."""
    _, want = _single_device_outputs(tmp_path)
    port = free_port()
    argv = ["-m", "tests.support.workers.sharded_export", str(tmp_path / "two"), "1,4,2"]
    results = finish([launch(argv, devices=4, process_id=p, port=port) for p in range(2)])
    outs = [_result(out) for _, out, _ in results]
    assert [o["processes"] for o in outs] == [2, 2] and not outs[0]["fully_addressable"]
    assert {o["fingerprint"] for o in outs} == {o["fingerprint_small_blocks"] for o in outs} == {want}
    for dtype in ("f32", "bf16"):
        assert _files(tmp_path / "two" / dtype) == _files(tmp_path / "one" / dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_streams_one_tensor_at_a_time_and_writes_what_it_wrote(tmp_path, monkeypatch, dtype):
    """Every tensor the writer gets is one layer of one parameter; the host's numpy peak
    during the export stays within a few tensors (the whole model is many times that); the
    files hold today's tensors (read back with the `safetensors` package), in order."""
    from safetensors import safe_open

    cfg = TINY_CONFIG.replace(tie_word_embeddings=False, num_layers=12, hidden_size=128, intermediate_size=512,
                             num_heads=4, num_kv_heads=2, head_dim=32)
    params = nn.meta.unbox(init_params(cfg, jax.random.key(2)))
    want = reference_tensors(params, cfg, np.dtype(jnp.dtype(dtype)))
    largest, total = max(t.nbytes for t in want.values()), sum(t.nbytes for t in want.values())
    handed = []
    write = hf.SafetensorsWriter.write
    monkeypatch.setattr(hf.SafetensorsWriter, "write", lambda self, name, a: (handed.append((name, a.nbytes)),
                                                                               write(self, name, a))[1])
    tracemalloc.start()
    try:
        files = hf.save_hf(params, cfg, str(tmp_path), dtype=dtype, max_shard_bytes=total // 3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [n for n, _ in handed] == list(want) and max(b for _, b in handed) == largest
    print(f"numpy peak {peak} B, largest tensor {largest} B, model {total} B")
    assert peak < 4 * largest + (256 << 10) < total / 4, (peak, largest, total)
    assert len(files) == 4  # three shards' worth plus the remainder
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total and list(index["weight_map"]) == list(want)
    for name, tensor in want.items():
        path = str(tmp_path / index["weight_map"][name])
        np.testing.assert_array_equal(hf.SafetensorsFile(path).get(name), tensor)
        if dtype == "float32":  # the reference reader too (its numpy side has no bfloat16)
            with safe_open(path, framework="numpy") as f:
                np.testing.assert_array_equal(f.get_tensor(name), tensor)


def test_writer_refuses_what_it_was_not_told(tmp_path):
    path = str(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="expected tensor 'a'"):
        with hf.SafetensorsWriter(path, [("a", np.float32, (2,))]) as w:
            w.write("a", np.zeros(3, np.float32))
    assert os.listdir(tmp_path) == []  # the temporary file is gone
    w = hf.SafetensorsWriter(path, [("a", np.float32, (2,)), ("b", np.float32, (1,))])
    w.write("a", np.ones(2, np.float32))
    with pytest.raises(ValueError, match="1 tensors unwritten"):
        w.close()
    assert os.listdir(tmp_path) == []


def test_export_keeps_the_params_dtype_by_default(tmp_path):
    """bfloat16 params export as bfloat16 without being told (not as the config's float32)."""
    from muajax.export import checkpoint_dtype

    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nn.meta.unbox(init_params(TINY_CONFIG, jax.random.key(0))))
    assert TINY_CONFIG.param_dtype == "float32" and checkpoint_dtype(params) == "bfloat16"
    hf.save_hf(params, TINY_CONFIG, str(tmp_path))
    stored = hf.SafetensorsFile(str(tmp_path / "model.safetensors"))
    assert {str(stored.dtype(name)) for name in stored.keys()} == {"bfloat16"}  # noqa: SIM118 - not a dict
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="mix dtypes"):
        checkpoint_dtype(dict(params, embed=params["embed"].astype(jnp.float32)))
