"""Atomic checkpoints: policy (safetensors), optimizer, and the run's position.

Layout of ``<out_dir>/checkpoint/``: the model folder (``save_pretrained``; with LoRA, the
adapters only, ``adapter.safetensors`` as published, and the tokenizer: the base stays in
``model.path``, whose hash the adapters carry, so a resume checks it), ``optim.pt``
(our own optimizer and scheduler state, loaded with ``weights_only=True``) and
``state.json`` (version, data position, config identity, extra role state).
A new checkpoint is written to ``checkpoint.tmp/`` and swapped into place by two renames
(the old one to ``checkpoint.old/``, the new one in). A write that fails (a full or
read-only disk) removes ``checkpoint.tmp/`` and raises ``CheckpointError`` naming the path
and the free space there, the last good checkpoint untouched; a later start removes a
``checkpoint.tmp/`` left by a process killed mid-write and, if it was killed between the two
renames, takes ``checkpoint.old/`` back (``recover``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from p2prl.config import Config, free_space
from p2prl.policy import Policy, load_policy
from p2prl.policy.model import is_lora
from p2prl.policy.weights import load_weights, serialize_weights

ADAPTER_FILE = "adapter.safetensors"

log = logging.getLogger("p2prl.checkpoint")


class CheckpointError(RuntimeError):
    pass


def disk_error(path: str | Path, e: BaseException, what: str) -> CheckpointError:
    """A failed write of ``what`` at ``path`` as one line: the reason, the free space there, what to do."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
    return CheckpointError(f"could not write {what} to {path}: {reason} ({free_space(path)} free there); "
                           "free some space or point train.out_dir at a writable disk with room")


def save_checkpoint(out_dir: str | Path, policy, optimizer, scheduler, cfg: Config, state: dict) -> Path:
    final = Path(out_dir) / "checkpoint"
    tmp = final.with_name("checkpoint.tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if is_lora(policy.model):
            (tmp / ADAPTER_FILE).write_bytes(serialize_weights(policy.model)[0])
        else:
            policy.model.save_pretrained(tmp, safe_serialization=True)
        policy.tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optim.pt")
        (tmp / "state.json").write_text(json.dumps({"identity": cfg.run_identity(), **state}, indent=1))
    except Exception as e:  # a full or read-only disk surfaces as OSError, or as torch's / safetensors' own errors
        shutil.rmtree(tmp, ignore_errors=True)
        err = disk_error(tmp, e, "a checkpoint")
        kept = f"; the last good checkpoint in {final} is kept" if (final / "state.json").exists() else ""
        raise CheckpointError(f"{err}{kept}") from e
    old = final.with_name("checkpoint.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def recover(out_dir: str | Path) -> None:
    """Tidy ``out_dir`` after a process died mid-checkpoint: a partial ``checkpoint.tmp/`` is removed, and a
    ``checkpoint.old/`` with no ``checkpoint/`` (killed between the two renames) becomes the checkpoint again."""
    final = Path(out_dir) / "checkpoint"
    tmp, old = final.with_name("checkpoint.tmp"), final.with_name("checkpoint.old")
    if tmp.exists():
        log.warning("removing %s, a checkpoint whose writing was cut off; resuming from the last good one", tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    if not final.exists() and (old / "state.json").is_file():
        log.warning("resuming from %s (the process writing a newer checkpoint died while swapping it in)", old)
        old.rename(final)


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
    recover(out_dir)
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
