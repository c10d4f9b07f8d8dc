"""Atomic checkpoints: policy (safetensors), optimizer, and the run's position.

Layout of ``<out_dir>/checkpoint/``: the model folder (``save_pretrained``; with LoRA, the
adapters only, ``adapter.safetensors`` as published, and the tokenizer: the base stays in
``model.path``, whose hash the adapters carry, so a resume checks it), ``optim.pt``
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
from p2prl.policy import Policy, load_policy
from p2prl.policy.model import is_lora
from p2prl.policy.weights import load_weights, serialize_weights

ADAPTER_FILE = "adapter.safetensors"


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(out_dir: str | Path, policy, optimizer, scheduler, cfg: Config, state: dict) -> Path:
    final = Path(out_dir) / "checkpoint"
    tmp = final.with_name("checkpoint.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if is_lora(policy.model):
        (tmp / ADAPTER_FILE).write_bytes(serialize_weights(policy.model)[0])
    else:
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


def load_checkpoint_policy(out_dir: str | Path, cfg: Config) -> Policy:
    """The policy of the checkpoint in ``out_dir``: its model folder, or the base folder with its saved adapters."""
    folder = Path(out_dir) / "checkpoint"
    if not cfg.model.lora_rank:
        return load_policy(folder, cfg.model)
    policy = load_policy(cfg.model.path, cfg.model)
    try:
        load_weights(policy.model, (folder / ADAPTER_FILE).read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the adapters in {folder} do not load onto model.path={cfg.model.path!r}: {e}") from e
    return policy


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
