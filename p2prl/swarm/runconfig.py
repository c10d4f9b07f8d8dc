"""The run's config in the DHT: a peer whose model, task or settings differ from the run's is refused at join.

Learners publish a ``RunConfigRecord`` with their heartbeat. A sampler compares the model (base hash and LoRA settings),
task and sampling settings with every live learner's record before it generates anything;
a learner compares those and the algorithm and optimizer settings before it trains. A
mismatch stops the peer with both values of every differing key, instead of letting it
produce records the run rejects one by one.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from p2prl.config import Config, ConfigError
from p2prl.policy.model import model_folder
from p2prl.swarm.dht import RunConfigRecord
from p2prl.tasks import Task

SAMPLER_SECTIONS = ("model", "lora", "task", "sampling")
LEARNER_SECTIONS = (*SAMPLER_SECTIONS, "algo", "optim")
PEER_LOCAL = ("backend", "vllm_dtype", "vllm_kv_cache_gib")  # sampling keys each peer chooses (how it generates, not what)
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
OPTIM_KEYS = ("steps", "groups_per_step", "lr", "warmup_frac", "lr_schedule", "lr_min_frac", "weight_decay", "max_grad_norm")
# files that decide what a model folder computes (weights, architecture, tokenizer, chat template)
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


class RunConfigMismatch(ConfigError):
    """This peer's config differs from the run's; the message lists every differing key with both values."""


@lru_cache(maxsize=8)
def _folder_hash(folder: Path, stamp: tuple) -> str:
    h = hashlib.sha256()
    for f in sorted({f for pattern in MODEL_FILES for f in folder.glob(pattern)}):
        if f.name == "generation_config.json":  # decoding defaults; p2prl's sampling section decides
            continue
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def model_hash(path: str) -> str:
    """sha256 over the files of a model folder (``builtin`` = the shipped model) that decide what it computes."""
    folder = model_folder(path).resolve()
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.iterdir()) if f.is_file())
    return _folder_hash(folder, stamp)


def lora_settings(cfg: Config) -> dict:
    """The model's LoRA settings as flat scalars (targets comma-joined); only the rank when LoRA is off."""
    m = cfg.model
    if not m.lora_rank:
        return {"lora_rank": 0}
    return {k: ",".join(sorted(v)) if isinstance(v, list) else v for k in LORA_KEYS for v in [getattr(m, k)]}


def run_config(cfg: Config, task: Task) -> RunConfigRecord:
    """This peer's view of the run's config."""
    return RunConfigRecord(
        model=model_hash(cfg.model.path), lora=lora_settings(cfg), task=task.fingerprint(),
        sampling={k: v for k, v in cfg.sampling.model_dump().items() if k not in PEER_LOCAL}, algo=cfg.algo.model_dump(),
        optim={k: getattr(cfg.train, k) for k in OPTIM_KEYS},
    )


def differences(run: RunConfigRecord, mine: RunConfigRecord, sections: tuple[str, ...]) -> list[str]:
    """``section.key: run has X, this peer has Y`` for every key of ``sections`` that differs."""
    out = []
    for s in sections:
        a, b = getattr(run, s), getattr(mine, s)
        if isinstance(a, dict):
            out += [f"{s}.{k}: the run has {a.get(k)!r}, this peer has {b.get(k)!r}"
                    for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{s}: the run has {a!r}, this peer has {b!r}")
    return out


def check(run_configs: dict[str, RunConfigRecord], mine: RunConfigRecord, role: str, run_id: str) -> None:
    """Raise ``RunConfigMismatch`` if any live learner's record differs from ``mine`` in what ``role`` must share."""
    sections = LEARNER_SECTIONS if role == "learner" else SAMPLER_SECTIONS
    for peer, rec in sorted(run_configs.items()):
        diff = differences(rec, mine, sections)
        if diff:
            raise RunConfigMismatch(
                f"this {role} does not match run {run_id!r} (as published by learner {peer[-6:]}):\n  "
                + "\n  ".join(diff)
                + "\nuse the run's config file (or the same overrides) to join it, or another --run-id for a new run"
            )
