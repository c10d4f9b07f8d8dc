"""Atomic checkpoints: policy (safetensors), optimizer, and the run's position.

Layout of ``<out_dir>/checkpoint/``: the model folder (``save_pretrained``), ``optim.pt``
(our own optimizer and scheduler state, loaded with ``weights_only=True``) and
``state.json`` (version, data position, config identity, extra role state).
A new checkpoint is written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from p2prl.config import Config


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(out_dir: str | Path, policy, optimizer, scheduler, cfg: Config, state: dict) -> Path:
    final = Path(out_dir) / "checkpoint"
    tmp = final.with_name("checkpoint.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.model.save_pretrained(tmp, safe_serialization=True)
    policy.tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optim.pt")
    (tmp / "state.json").write_text(json.dumps({"identity": cfg.run_identity(), **state}, indent=1))
    old = final.with_name("checkpoint.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(out_dir: str | Path, cfg: Config) -> dict | None:
    """The saved state of a run in ``out_dir``, or None; refuses a checkpoint of another config."""
    path = Path(out_dir) / "checkpoint" / "state.json"
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    saved, now = state.get("identity", {}), cfg.run_identity()
    diffs = [
        f"{sec}.{k}: checkpoint {saved.get(sec, {}).get(k)!r}, config {v!r}"
        for sec, fields in now.items()
        for k, v in fields.items()
        if saved.get(sec, {}).get(k) != v
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint in {path.parent} was made with another config:\n  " + "\n  ".join(diffs)
            + "\nuse another train.out_dir, or start fresh with --fresh"
        )
    return state


def load_optimizer(out_dir: str | Path, optimizer, scheduler) -> None:
    blob = torch.load(Path(out_dir) / "checkpoint" / "optim.pt", weights_only=True)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
