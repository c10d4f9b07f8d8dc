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

Before a learner (or ``p2prl train``) loads its model, ``check_disk`` estimates the size of its checkpoint
from the model folder's safetensors headers (the weights, or a LoRA policy's adapters, and AdamW's two
moments of what is trained) and refuses to start, in one line, when ``train.out_dir`` lacks room for two
of them (the checkpoint and the next one written beside it) and a margin: a full disk is found before
any training is done, not at the first checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import struct
from pathlib import Path

import torch

from p2prl.config import Config, format_bytes, free_bytes, free_space
from p2prl.policy import Policy, load_policy
from p2prl.policy.model import is_lora, model_folder
from p2prl.policy.weights import load_weights, serialize_weights

ADAPTER_FILE = "adapter.safetensors"

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    pass


def disk_error(path: str | Path, e: BaseException, what: str) -> CheckpointError:
    """A failed write of ``what`` at ``path`` as one line: the reason, the free space there, what to do."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
    return CheckpointError(f"could not write {what} to {path}: {reason} ({free_space(path)} free there); "
                           "free some space or point train.out_dir at a writable disk with room")


# what ``check_disk`` asks of train.out_dir: two checkpoints (the last good one and the next, written beside it in
# checkpoint.tmp/) and half of one more for the estimate's misses, the logs, metrics and own groups of the run
CHECKPOINT_ROOM = 2.5
HEADROOM_BYTES = 10_000_000
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _safetensors_shapes(path: Path) -> list[tuple[str, list[int]]]:
    """(name, shape) of every tensor in a safetensors file, from its header (the weights are not read)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [(k, v["shape"]) for k, v in header.items() if k != "__metadata__"]


def checkpoint_bytes(cfg: Config) -> int:
    """An estimate of the size of a checkpoint of ``cfg``'s policy, from ``model.path`` without loading it: the
    weights in ``model.dtype`` (a LoRA policy: its adapters, at 4 bytes a number), AdamW's two moments of the same,
    and the folder's other files (tokenizer, config). A folder without safetensors counts its weight files' bytes."""
    folder = model_folder(cfg.model.path)
    weights = [f for pattern in WEIGHT_FILES for f in folder.glob(pattern) if f.is_file()]
    others = sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f not in weights)
    shapes = [s for f in weights if f.suffix == ".safetensors" for s in _safetensors_shapes(f)]
    m = cfg.model
    if m.lora_rank:
        targets = set(m.lora_targets)
        trained = sum(m.lora_rank * (shape[0] + shape[1]) for name, shape in shapes
                      if len(shape) == 2 and name.endswith(".weight") and name.rsplit(".", 2)[-2] in targets) * 4
    elif shapes:
        trained = sum(math.prod(shape) for _, shape in shapes) * DTYPE_BYTES[m.dtype]
    else:
        trained = sum(f.stat().st_size for f in weights)
    return 3 * trained + others  # the weights and the optimizer's exp_avg and exp_avg_sq


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def check_disk(cfg: Config, out_dir: str | Path | None = None, learners: int = 1) -> None:
    """Refuse to start (``CheckpointError``, one line: the path, the free space, the space needed) when ``out_dir``
    (default ``train.out_dir``) lacks room for ``CHECKPOINT_ROOM`` checkpoints of each of ``learners`` learners
    (`p2prl swarm up`: theirs share a disk); what a checkpoint already there (and a partial one that the start
    removes) takes counts as room."""
    if not cfg.train.check_disk:
        return
    out = Path(out_dir if out_dir is not None else cfg.train.out_dir).expanduser().absolute()
    try:
        size = checkpoint_bytes(cfg)
    except (OSError, ValueError, KeyError):  # a model folder that cannot be read: loading it says what is wrong
        return
    final = out / "checkpoint"
    reclaimed = sum(_tree_bytes(final.with_name(n)) for n in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    needed = max(0, math.ceil(CHECKPOINT_ROOM * size * learners) - reclaimed) + HEADROOM_BYTES
    free = free_bytes(out)
    if free is not None and free < needed:  # None: nothing to measure, the write itself will say
        each = f" for its {learners} learners" if learners > 1 else ""
        raise CheckpointError(
            f"train.out_dir={str(out)!r} has {format_bytes(free)} free, and a run of this model needs about "
            f"{format_bytes(needed)} there{each} (checkpoints of about {format_bytes(size)}: the last good one and "
            "the next written beside it, and its logs); free some space or point train.out_dir at a disk with room")


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
