import errno
import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointLayoutError,
    CheckpointReadError,
    NoValidCheckpointError,
    rng_from_json,
    rng_to_json,
)


def make_state(seed=0.0):
    w = jnp.arange(4000, dtype=jnp.float32).reshape(40, 100) * 0.37 + seed
    w = w.at[0, 0].set(jnp.nan).at[0, 1].set(-0.0)  # bit-exactness, not just ==
    return {
        "params": {"w": w, "b": (jnp.arange(6, dtype=jnp.bfloat16) / 3 + seed).astype(jnp.bfloat16)},
        "opt": [jnp.int32(7 + int(seed)), {"mu": jnp.full((5,), 1e-30 + seed, jnp.float32),
                                          "mask": jnp.array([True, False, True])}],
    }


def abstract_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(bits(x), bits(y))


def save_steps(directory, steps, keep=3, **kw):
    ck = Checkpointer(directory, keep=keep, every_steps=1, **kw)
    for s in steps:
        assert ck.save(s, make_state(float(s)), rng=jax.random.key(s), data_position={"index": s * 10})
    ck.close()


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


def biggest_file(step_dir):
    files = [f for f in glob.glob(os.path.join(step_dir, "state", "**"), recursive=True) if os.path.isfile(f)]
    return max(files, key=os.path.getsize)


def truncate_data(step_dir):
    f = biggest_file(step_dir)
    os.truncate(f, os.path.getsize(f) // 2)


def garbage_in_data(step_dir):
    f = biggest_file(step_dir)
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) // 2)
        fh.write(b"\xde\xad\xbe\xef" * 16)


def delete_metadata(step_dir):
    os.remove(os.path.join(step_dir, "meta", "metadata"))


def garbage_metadata(step_dir):
    with open(os.path.join(step_dir, "meta", "metadata"), "w") as fh:
        fh.write("{not json")


def delete_state_dir(step_dir):
    shutil.rmtree(os.path.join(step_dir, "state"))


@pytest.mark.parametrize("corrupt, reason", [
    (truncate_data, r"arrays: truncated file \(.*OUT_OF_RANGE"),
    (garbage_in_data, r"arrays: leaf .* does not match its saved fingerprint"),
    (delete_metadata, r"metadata: missing file \(FileNotFoundError"),
    (garbage_metadata, r"metadata: garbled file \(JSONDecodeError"),
    (delete_state_dir, r"arrays: missing item"),
])
def test_corrupt_latest_falls_back(tmp_path, caplog, corrupt, reason):
    save_steps(tmp_path, [1, 2, 3])
    corrupt(os.path.join(tmp_path, "3"))
    ck = Checkpointer(tmp_path, keep=3)
    with caplog.at_level(logging.WARNING, logger="muajax.runtime.checkpoint"):
        got = ck.restore_latest(abstract_of(make_state()))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors
    assert re.search(rf"checkpoint .*/3 is corrupt \({reason}.*\); trying the one before", errors[0]), errors[0]
    # quarantine is an error naming both steps: the corrupt one and the one the run goes on from
    assert re.search(r"checkpoint step 3 is corrupt: moved .*/3 to .*/corrupt/3\..*; the run resumes from step 2",
                     errors[1]), errors[1]
    retried = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("reading it again" in m for m in retried)  # a content error counts only if it repeats
    assert got.step == 2 and got.data_position == {"index": 20}
    assert_bit_equal(got.state, make_state(2.0))
    # The bad step was moved aside, not deleted, so step 3 can be saved again.
    assert [n.split(".")[0] for n in os.listdir(tmp_path / "corrupt")] == ["3"]
    assert ck.steps() == [1, 2]
    assert ck.save(3, make_state(33.0))
    assert_bit_equal(ck.restore_latest(abstract_of(make_state())).state, make_state(33.0))
    ck.close()


def fail_reading(ck, step, item, error, times=None):
    """Make the Checkpointer's reads of `item` ("state" or "meta") at `step` raise `error`
    (every time, or the first `times` times); returns the list of calls seen."""
    real, calls = ck._manager.restore, []

    def restore(s, args=None, **kw):
        if s == step and item in args.keys():
            calls.append(s)
            if times is None or len(calls) <= times:
                raise error
        return real(s, args=args, **kw)

    ck._manager.restore = restore
    return calls


READ_ERRORS = {
    "io": OSError(errno.EIO, "Input/output error"),
    "permission": PermissionError(errno.EACCES, "Permission denied"),
    "bucket": ValueError("UNAVAILABLE: Error reading \"params.w/0.0\" from gs://bucket/ck: connection reset"),
    "bucket-timeout": ValueError("DEADLINE_EXCEEDED: Error reading \"params.w/0.0\""),
    "oom": MemoryError("host out of memory"),
    "device-oom": RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8589934592 bytes"),
    "sharding": ValueError("One of device_put args was given the sharding of NamedSharding(mesh=Mesh('x': 3)), "
                           "which implies that the global size of its dimension 0 should be divisible by 3"),
}


@pytest.mark.parametrize("item", ["state", "meta"])
@pytest.mark.parametrize("kind", sorted(READ_ERRORS))
def test_a_read_error_that_is_not_about_content_stops_and_moves_nothing(tmp_path, caplog, kind, item):
    save_steps(tmp_path, [1, 2])
    ck = Checkpointer(tmp_path)
    wrapped = Exception("Encountered error while reading array index")  # orbax's wrapper of tensorstore's error
    wrapped.__cause__ = READ_ERRORS[kind]
    calls = fail_reading(ck, 2, item, wrapped)
    with caplog.at_level(logging.WARNING, logger="muajax.runtime.checkpoint"):
        with pytest.raises(CheckpointReadError, match=r"/2: reading the (arrays|metadata) failed with an error "
                                                      r"that is not about the checkpoint's content.*moving any"):
            ck.restore_latest(abstract_of(make_state()))
    assert calls == [2]  # not retried, not walked past: step 1 was never tried
    assert sorted(os.listdir(tmp_path)) == ["1", "2"] and ck.steps() == [1, 2]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    ck.close()


def test_a_content_error_that_does_not_repeat_is_not_corruption(tmp_path, caplog):
    save_steps(tmp_path, [1, 2])
    ck = Checkpointer(tmp_path)
    calls = fail_reading(ck, 2, "state", ValueError("DATA_LOSS: Error reading \"params.w/0.0\": bad bytes"),
                         times=1)
    with caplog.at_level(logging.WARNING, logger="muajax.runtime.checkpoint"):
        got = ck.restore_latest(abstract_of(make_state()))
    assert calls == [2, 2] and got.step == 2
    assert_bit_equal(got.state, make_state(2.0))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # the retry, and no error
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]
    ck.close()


def test_a_read_error_on_the_second_read_of_a_corrupt_step_stops_too(tmp_path):
    save_steps(tmp_path, [1, 2])
    ck = Checkpointer(tmp_path)
    errors = iter([ValueError("DATA_LOSS: garbled"), OSError(errno.EIO, "Input/output error")])
    real = ck._manager.restore

    def restore(s, args=None, **kw):
        if s == 2 and "state" in args.keys():
            raise next(errors)
        return real(s, args=args, **kw)

    ck._manager.restore = restore
    with pytest.raises(CheckpointReadError, match="OSError"):
        ck.restore_latest(abstract_of(make_state()))
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]
    ck.close()


@pytest.mark.parametrize("error, content", [
    (FileNotFoundError(2, "No such file", "/ck/3/meta/metadata"), True),
    (json.JSONDecodeError("Expecting value", "{", 1), True),
    (ValueError("NOT_FOUND: Error reading \"x\" in OCDBT database"), True),
    (ValueError("OUT_OF_RANGE: Requested byte range [0, 13605) is not valid for value of size 7004"), True),
    (ValueError("FAILED_PRECONDITION: Error reading: Truncated Zstd-compressed stream"), True),
    (ValueError("FAILED_PRECONDITION: generation mismatch"), False),
    (OSError(errno.EIO, "Input/output error"), False),
    (ConnectionResetError(), False),
    (TimeoutError(), False),
    (MemoryError(), False),
    (ValueError("UNAVAILABLE: DATA_LOSS while streaming"), False),
    (ValueError("shapes (3,) and (4,) differ"), False),
    (KeyError("Item \"state\" was not found in the checkpoint. Available items: ['meta']"), True),
])
def test_content_problem_reads_the_evidence(error, content):
    from muajax.runtime.checkpoint_errors import content_problem

    assert (content_problem(error) is not None) == content
    outer = Exception("Encountered error while reading array index")
    outer.__cause__ = error
    assert (content_problem(outer) is not None) == content
    # an environmental error anywhere in the chain wins over content evidence
    mixed = ValueError("DATA_LOSS: garbled")
    mixed.__context__ = OSError(errno.EIO, "Input/output error")
    assert content_problem(mixed) is None


def test_interrupted_save_tmp_dir_is_ignored(tmp_path):
    save_steps(tmp_path, [1, 2])
    # What kill -9 mid-save leaves: a partial step written under orbax's temporary name.
    partial = tmp_path / "3.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "2", partial)
    shutil.rmtree(partial / "meta")
    truncate_data(str(partial))
    with pytest.warns(RuntimeWarning, match=r"unfinalized checkpoint directory 3.orbax-checkpoint-tmp"):
        ck = Checkpointer(tmp_path, keep=3)
    assert ck.steps() == [1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the finalized checkpoints are fine: no fallback warning
        got = ck.restore_latest(abstract_of(make_state()))
    assert got.step == 2
    assert ck.save(3, make_state(3.0))
    assert ck.restore_latest(abstract_of(make_state())).step == 3
    ck.close()
    assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(tmp_path))


def test_nothing_valid_left(tmp_path, caplog):
    save_steps(tmp_path, [1, 2])
    garbage_metadata(os.path.join(tmp_path, "1"))
    garbage_in_data(os.path.join(tmp_path, "2"))
    ck = Checkpointer(tmp_path)
    with caplog.at_level(logging.ERROR, logger="muajax.runtime.checkpoint"):
        with pytest.raises(NoValidCheckpointError,
                           match=r"no valid checkpoint left \(step 2: .*fingerprint.*; step 1: metadata.*nothing was "
                                 r"moved"):
            ck.restore_latest(abstract_of(make_state()))
    assert len(caplog.records) == 2 and all("is corrupt" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # nothing moved when nothing restores
    with pytest.raises(CheckpointError, match="fingerprint"):
        ck.restore(2, abstract_of(make_state()))


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
