"""The Checkpointer on bad checkpoints: corrupt steps fall back and are moved aside, read
errors that are not about content stop without moving anything, interrupted saves are ignored."""

import errno
import glob
import json
import logging
import os
import re
import shutil
import warnings

import pytest

from muajax.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointReadError,
    NoValidCheckpointError,
)
from tests.runtime.checkpoint_support import abstract_of, assert_bit_equal, make_state, save_steps


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
