"""Checkpoints on a bad disk: a failed write keeps the last good checkpoint and says where and how much space is
free; a start after a process died mid-checkpoint neither trusts nor trips over what it left."""

import errno
import json

import pytest
import torch

from p2prl.config import Config
from p2prl.learner.checkpoint import CheckpointError, read_state, recover, save_checkpoint
from p2prl.learner.core import LearnerCore, resume_learner
from p2prl.policy import load_policy


@pytest.fixture
def core():
    return LearnerCore(load_policy("builtin"), Config())


def save(core, out, version):
    return save_checkpoint(out, core.policy, core.optimizer, core.scheduler, Config(), {"version": version})


def test_a_failed_write_keeps_the_last_good_checkpoint_and_names_the_path_and_free_space(core, tmp_path, monkeypatch):
    save(core, tmp_path, 1)

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 942976 vs 942868")

    monkeypatch.setattr(torch, "save", full)  # what torch raises when the disk fills mid-write
    with pytest.raises(CheckpointError) as e:
        save(core, tmp_path, 2)
    msg = str(e.value)
    assert str(tmp_path / "checkpoint.tmp") in msg and " free there" in msg and "last good checkpoint" in msg, msg
    assert not (tmp_path / "checkpoint.tmp").exists()
    assert read_state(tmp_path, Config())["version"] == 1


def test_an_os_error_reads_as_its_reason(core, tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(CheckpointError, match=r"No space left on device \(.* free there\)"):
        save(core, tmp_path, 1)
    assert not (tmp_path / "checkpoint").exists() and not (tmp_path / "checkpoint.tmp").exists()


def test_a_start_removes_a_partial_checkpoint_and_resumes_from_the_last_good_one(core, tmp_path):
    save(core, tmp_path, 3)
    partial = tmp_path / "checkpoint.tmp"  # a process killed while writing v4's checkpoint
    partial.mkdir()
    (partial / "optim.pt").write_bytes(b"\x00" * 10)
    resumed, state = resume_learner(Config.model_validate({"train": {"out_dir": str(tmp_path)}}), tmp_path)
    assert state["version"] == 3 and resumed.version == 3
    assert not partial.exists()


def test_a_process_killed_between_the_two_renames_resumes_from_the_old_checkpoint(core, tmp_path):
    save(core, tmp_path, 5)
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")
    recover(tmp_path)
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text())["version"] == 5
    assert not (tmp_path / "checkpoint.old").exists()
