"""The Checkpointer: saving and restoring bit-exactly, keep and interval, layout errors,
resharding on restore, and directories given as strings, epath paths or URLs."""

import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointLayoutError,
    rng_from_json,
    rng_to_json,
)
from tests.runtime.checkpoint_support import abstract_of, assert_bit_equal, make_state, save_steps


@pytest.mark.parametrize("async_save", [True, False])
def test_save_restore_bit_exact(tmp_path, async_save):
    state = make_state(1.0)
    cfg = {"grpo": {"learning_rate": 1e-6}, "run": {"name": "t"}}
    with Checkpointer(tmp_path / "ck", keep=3, every_steps=5, async_save=async_save) as ck:
        assert ck.restore_latest(abstract_of(state)) is None
        assert not ck.save(3, state) and not ck.should_save(3)
        assert ck.save(5, state, rng=jax.random.key(42), data_position={"epoch": 1, "index": 17}, config=cfg,
                       extra={"note": "x"})
        got = ck.restore_latest(abstract_of(state))
    assert got.step == 5
    assert_bit_equal(got.state, state)
    assert got.data_position == {"epoch": 1, "index": 17} and got.config == cfg
    assert got.metadata["extra"] == {"note": "x"} and got.metadata["step"] == 5
    assert jnp.array_equal(jax.random.key_data(got.rng), jax.random.key_data(jax.random.key(42)))
    # A new process sees the same thing.
    again = Checkpointer(tmp_path / "ck").restore_latest(state)  # concrete arrays work as the abstract tree
    assert again.step == 5
    assert_bit_equal(again.state, state)


def test_rng_json_round_trip():
    raw = jax.random.PRNGKey(3)
    assert jnp.array_equal(rng_from_json(rng_to_json(raw)), raw)
    typed = jax.random.key(9)
    back = rng_from_json(rng_to_json(typed))
    assert jax.random.key_impl(back) == jax.random.key_impl(typed)
    assert jnp.array_equal(jax.random.key_data(back), jax.random.key_data(typed))
    assert rng_to_json(None) is None and rng_from_json(None) is None
    with pytest.raises(TypeError, match="uint32 PRNGKey"):
        rng_to_json(jnp.zeros(2, jnp.float32))


def test_keep_and_interval(tmp_path):
    ck = Checkpointer(tmp_path, keep=2, every_steps=2)
    for step in range(1, 9):
        saved = ck.save(step, make_state(float(step)))
        assert saved == (step % 2 == 0)
    assert ck.save(9, make_state(9.0), force=True)
    assert ck.steps() == [8, 9]
    assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["8", "9"]
    with pytest.raises(CheckpointError, match="step 9 already exists"):
        ck.save(9, make_state(), force=True)
    assert ck.restore(8, abstract_of(make_state())).step == 8
    ck.close()
    with pytest.raises(ValueError, match="keep must be"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        Checkpointer(tmp_path).save(-1, make_state())


def test_wrong_abstract_state_is_an_error_not_corruption(tmp_path):
    save_steps(tmp_path, [1, 2])
    ck = Checkpointer(tmp_path)
    wrong = make_state()
    wrong["params"]["extra"] = jnp.zeros(2)
    with pytest.raises(CheckpointLayoutError, match=r"different tree.*\['params'\]\['extra'\]"):
        ck.restore_latest(abstract_of(wrong))
    shaped = make_state()
    shaped["params"]["w"] = jnp.zeros((4, 10))
    with pytest.raises(CheckpointLayoutError, match=r"\['params'\]\['w'\] was saved with shape \(40, 100\).*\(4, 10\)"):
        ck.restore_latest(abstract_of(shaped))
    assert ck.steps() == [1, 2] and not os.path.exists(tmp_path / "corrupt")


def test_metadata_must_be_json(tmp_path):
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(TypeError, match=r"metadata.data_position.order \(ndarray\) is not"):
            ck.save(1, make_state(), data_position={"order": np.arange(3)})
        assert ck.steps() == []


MULTI_DEVICE = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("error", RuntimeWarning)
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from muajax.runtime.checkpoint import Checkpointer
    assert jax.device_count() == 8, jax.devices()
    devs = np.array(jax.devices())
    mesh_a = Mesh(devs.reshape(2, 4), ("data", "fsdp"))
    w = jnp.arange(16 * 24, dtype=jnp.float32).reshape(16, 24) / 7
    state = {"w": jax.device_put(w, NamedSharding(mesh_a, P("data", "fsdp"))),
             "v": jax.device_put(w.astype(jnp.bfloat16).T, NamedSharding(mesh_a, P("fsdp", None)))}
    ck = Checkpointer(sys.argv[1], keep=2)
    ck.save(1, state)
    ck.close()
    mesh_b = Mesh(devs.reshape(8), ("x",))
    targets = {"w": NamedSharding(mesh_b, P(None, "x")), "v": NamedSharding(mesh_b, P())}
    abstract = {k: jax.ShapeDtypeStruct(state[k].shape, state[k].dtype, sharding=targets[k]) for k in state}
    got = Checkpointer(sys.argv[1]).restore_latest(abstract)
    for k in state:
        assert got.state[k].sharding == targets[k], (k, got.state[k].sharding)
        np.testing.assert_array_equal(np.asarray(got.state[k]).view(np.uint16 if k == "v" else np.uint32),
                                      np.asarray(state[k]).view(np.uint16 if k == "v" else np.uint32))
    shard_shapes = {s.data.shape for s in got.state["w"].addressable_shards}
    assert shard_shapes == {(16, 3)}, shard_shapes
    print("RESHARD_OK")
""")


def test_restore_onto_different_sharding(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", MULTI_DEVICE, str(tmp_path / "ck")], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "RESHARD_OK" in proc.stdout, proc.stderr[-3000:]


# ------------------------------------------------------------------ directories as epath paths

def test_local_directory_given_as_string_epath_or_file_url(tmp_path, monkeypatch):
    """A relative string, an epath.Path and a file:// URL all name the same local directory."""
    from etils import epath

    monkeypatch.chdir(tmp_path)
    save_steps("rel/ck", [1, 2])  # relative: resolved against the working directory once
    want = epath.Path(tmp_path / "rel" / "ck")
    for given in ("rel/ck", epath.Path(tmp_path / "rel" / "ck"), f"file://{tmp_path}/rel/ck"):
        ck = Checkpointer(given)
        assert isinstance(ck.directory, epath.Path) and ck.directory == want, given
        assert ck.steps() == [1, 2]
        got = ck.restore_latest(abstract_of(make_state()))
        assert got.step == 2 and got.data_position == {"index": 20}
        assert_bit_equal(got.state, make_state(2.0))
        ck.close()
    monkeypatch.chdir("/")  # later saves still go where the path pointed when it was given
    ck = Checkpointer(want, keep=3)
    assert ck.save(3, make_state(3.0)) and ck.steps() == [1, 2, 3]
    ck.close()
    assert sorted(os.listdir(tmp_path / "rel" / "ck")) == ["1", "2", "3"]


def test_checkpoint_path_keeps_urls_and_rejects_bad_input(tmp_path):
    from etils import epath

    from muajax.runtime.checkpoint import checkpoint_path

    for url in ("gs://bucket/run/checkpoints", "s3://bucket/ck", "az://container/ck"):
        p = checkpoint_path(url)
        assert isinstance(p, epath.Path) and str(p) == url and os.fspath(p) == url
        assert str(p / "7") == url + "/7"
    assert str(checkpoint_path(epath.Path("gs://b/x"))) == "gs://b/x"  # an epath URL stays one too
    assert str(checkpoint_path(f"file://{tmp_path}/ck")) == f"{tmp_path}/ck"
    with pytest.raises(ValueError, match=r"no filesystem for 'ftp://'"):
        checkpoint_path("ftp://host/ck")
    with pytest.raises(ValueError, match=r"file:// URL must name a local path"):
        checkpoint_path("file://otherhost/ck")
    with pytest.raises(ValueError, match="non-empty"):
        checkpoint_path("")
    with pytest.raises(TypeError, match="str or path"):
        checkpoint_path(3)


@pytest.fixture
def fake_bucket(monkeypatch):
    """gs:// served from memory: epath's fsspec backend gets an in-memory filesystem.

    No network here, so nothing can reach GCS. orbax's own GCS calls (google-cloud-storage,
    tensorstore's driver) are not exercised; the Checkpointer's manager is replaced with
    a recorder, and what is tested is the Checkpointer's own directory handling on a URL.
    """
    from etils.epath import backend
    from fsspec.implementations.memory import MemoryFileSystem

    class FakeGCS(MemoryFileSystem):
        protocol = ("gs", "gcs")
        store: dict = {}  # its own store, not MemoryFileSystem's process-wide one
        pseudo_dirs = [""]

    fs = FakeGCS(skip_instance_cache=True)
    monkeypatch.setattr(backend.fsspec_backend, "fs", lambda path: fs)

    class RecordingManager:
        made = []

        def __init__(self, directory, options=None, item_names=None):
            self.directory = directory
            RecordingManager.made.append(self)

        def all_steps(self):  # what orbax counts as finished on gs://: the commit marker
            root = str(self.directory)
            return [int(p.rsplit("/", 1)[1]) for p in fs.ls(root, detail=False)
                    if p.rsplit("/", 1)[1].isdigit() and fs.exists(f"{p}/commit_success.txt")]

        def reload(self):
            pass

        def wait_until_finished(self):
            pass

        def close(self):
            pass

    import orbax.checkpoint as ocp
    monkeypatch.setattr(ocp, "CheckpointManager", RecordingManager)
    return fs, RecordingManager


def test_gs_url_is_kept_for_orbax_and_for_directory_handling(fake_bucket, caplog):
    from etils import epath

    fs, manager = fake_bucket
    url = "gs://bucket/run/checkpoints"
    for step in (1, 2):
        fs.pipe(f"{url}/{step}/state/data", b"x")
        fs.pipe(f"{url}/{step}/commit_success.txt", b"ok")
    fs.pipe(f"{url}/3/state/data", b"half")  # interrupted: no commit marker yet
    with pytest.warns(RuntimeWarning, match=r"gs://bucket/run/checkpoints: ignoring unfinalized checkpoint "
                                            r"directory 3 left by an interrupted save"):
        ck = Checkpointer(url, keep=2)
    assert isinstance(ck.directory, epath.Path) and str(ck.directory) == url
    assert str(manager.made[-1].directory) == url  # orbax is handed the URL, not <cwd>/gs:/...
    assert str(ck._step_dir(2)) == f"{url}/2"
    assert ck.steps() == [1, 2]
    # A bad step is moved aside inside the bucket, objects and all.
    with caplog.at_level(logging.ERROR, logger="muajax.runtime.checkpoint"):
        ck._quarantine([2], resumed_from=1)
    assert re.search(r"step 2 is corrupt: moved gs://bucket/run/checkpoints/2 to gs://bucket/run/checkpoints/"
                     r"corrupt/2\..*resumes from step 1", caplog.records[-1].getMessage())
    assert ck.steps() == [1]
    moved = [p for p in fs.find(f"{url}/corrupt") if p.endswith("/state/data")]
    assert len(moved) == 1 and fs.cat(moved[0]) == b"x"
    assert not fs.exists(f"{url}/2/state/data")
