"""Checkpoints on a bad disk: a start without room for its checkpoints is refused at once (preflight); a failed write
keeps the last good checkpoint and says where and how much space is free; a start after a process died mid-checkpoint
neither trusts nor trips over what it left."""

import errno
import json
import shutil

import pytest
import torch

from p2prl.config import Config
from p2prl.learner.checkpoint import (
    CHECKPOINT_ROOM, HEADROOM_BYTES, CheckpointError, check_disk, checkpoint_bytes, read_state, recover,
    save_checkpoint,
)
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


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_a_write_cut_off_mid_file_leaves_nothing_the_next_start_trusts_or_trips_over(core, tmp_path, monkeypatch, err):
    save(core, tmp_path, 1)
    real = torch.save

    def truncated(obj, path, *args, **kwargs):  # some bytes reach the disk, then it is full
        open(path, "wb").write(b"PK\x03\x04" + b"\x00" * 100)
        raise OSError(err, errno.errorcode[err])

    monkeypatch.setattr(torch, "save", truncated)
    with pytest.raises(CheckpointError) as e:
        save(core, tmp_path, 2)
    assert len(str(e.value).splitlines()) == 1 and str(tmp_path / "checkpoint.tmp") in str(e.value)
    assert not (tmp_path / "checkpoint.tmp").exists()
    monkeypatch.setattr(torch, "save", real)
    resumed, state = resume_learner(Config.model_validate({"train": {"out_dir": str(tmp_path)}}), tmp_path)
    assert state["version"] == 1 and resumed.version == 1
    save(core, tmp_path, 2)  # room again: the next checkpoint is written as usual
    assert read_state(tmp_path, Config())["version"] == 2


def stepped(c: LearnerCore) -> LearnerCore:
    """``c`` after one optimizer step: AdamW's state (two moments of every trained number) exists from then on."""
    for p in c.params:
        p.grad = torch.full_like(p, 1e-3)
    c.optimizer.step()
    return c


def test_the_estimate_of_a_checkpoint_is_close_to_its_size_on_disk(tmp_path):
    for i, section in enumerate([{}, {"dtype": "bfloat16"}, {"lora_rank": 8}]):
        cfg = Config.model_validate({"model": section})
        c = stepped(LearnerCore(load_policy(cfg.model.path, cfg.model), cfg))
        folder = save_checkpoint(tmp_path / str(i), c.policy, c.optimizer, c.scheduler, cfg, {"version": 1})
        on_disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        assert 0.8 * on_disk < checkpoint_bytes(cfg) <= on_disk, (section, checkpoint_bytes(cfg), on_disk)
    full, lora = checkpoint_bytes(Config()), checkpoint_bytes(Config.model_validate({"model": {"lora_rank": 8}}))
    assert lora < full / 3


def free(n: int):
    return lambda path: shutil._ntuple_diskusage(10 * n, 10 * n - n, n)


def test_preflight_refuses_a_disk_without_room_for_two_checkpoints_in_one_line(tmp_path, monkeypatch):
    cfg = Config.model_validate({"train": {"out_dir": str(tmp_path / "run")}})
    size = checkpoint_bytes(cfg)
    monkeypatch.setattr(shutil, "disk_usage", free(size))
    with pytest.raises(CheckpointError) as e:
        check_disk(cfg)
    msg = str(e.value)
    needed = CHECKPOINT_ROOM * size + HEADROOM_BYTES
    assert "\n" not in msg and repr(str(tmp_path / "run")) in msg, msg
    assert f"has {size / 1e6:.1f} MB free" in msg and f"needs about {needed / 1e6:.1f} MB" in msg, msg
    monkeypatch.setattr(shutil, "disk_usage", free(int(needed) + 1))
    check_disk(cfg)


def test_preflight_counts_the_checkpoint_there_as_room(core, tmp_path, monkeypatch):
    cfg = Config.model_validate({"train": {"out_dir": str(tmp_path)}})
    size = checkpoint_bytes(cfg)
    save(stepped(core), tmp_path, 1)
    monkeypatch.setattr(shutil, "disk_usage", free(int(1.6 * size) + HEADROOM_BYTES))
    check_disk(cfg)  # one more checkpoint and the margin fit beside the one there
    shutil.rmtree(tmp_path / "checkpoint")
    with pytest.raises(CheckpointError):
        check_disk(cfg)


def test_p2prl_train_refuses_to_start_on_a_full_disk(tmp_path, monkeypatch, capsys):
    from p2prl.cli import main

    monkeypatch.setattr(shutil, "disk_usage", free(1_000_000))
    assert main(["train", f"train.out_dir={tmp_path}", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("p2prl train: error: train.out_dir=") and "1.0 MB free" in err and "\n" not in err, err
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoint").exists()


class FullDisk:
    """A file whose writes fail as on a disk that filled: the first ``room`` lines fit."""

    def __init__(self, room: int):
        self.room = room

    def write(self, text: str) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= 1
        return len(text)

    def close(self) -> None:  # a buffered file flushes the line that did not fit again, and fails again
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")


def test_p2prl_train_on_a_disk_that_fills_mid_run_stops_with_one_line(tmp_path, monkeypatch, capsys):
    from p2prl import metrics
    from p2prl.cli import main

    made = metrics.JsonlSink.__init__

    def on_full_disk(self, path, error=None):
        made(self, path, error)
        self._f.close()
        self._f = FullDisk(room=1)  # the base policy's accuracy fits, the first step's metrics do not

    monkeypatch.setattr(metrics.JsonlSink, "__init__", on_full_disk)
    assert main(["train", f"train.out_dir={tmp_path}", "train.steps=3", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    said = f"p2prl train: error: could not write metrics.jsonl to {tmp_path}: No space left on device ("
    assert err.startswith(said), err
    assert " free there); free some space" in err and "\n" not in err and "Traceback" not in err, err


def test_a_failed_metrics_write_raises_what_its_sink_was_told_and_close_adds_nothing(tmp_path):
    from p2prl.learner.checkpoint import disk_error
    from p2prl.metrics import JsonlSink

    sink = JsonlSink(tmp_path / "metrics.jsonl", lambda e: disk_error(tmp_path, e, "metrics.jsonl"))
    sink._f.close()
    sink._f = FullDisk(room=0)
    with pytest.raises(CheckpointError, match="could not write metrics.jsonl to .*No space left on device"):
        sink.log(1, {"x": 1.0})
    sink.close()  # the failure was said once
