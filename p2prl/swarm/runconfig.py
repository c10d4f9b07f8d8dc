"""The run's config in the DHT: a peer whose model, task or settings differ from the run's is refused at join.

Learners publish a ``RunConfigRecord`` with their heartbeat. A sampler compares the model (base hash and LoRA settings),
task and sampling settings with every live learner's record before it generates anything;
a learner compares those and the algorithm and optimizer settings before it trains. A
mismatch stops the peer with both values of every differing key, instead of letting it
produce records the run rejects one by one.
"""

from __future__ import annotations

from p2prl.config import Config, ConfigError
from p2prl.policy.model import model_hash
from p2prl.swarm.dht import RunConfigRecord
from p2prl.tasks import Task

SAMPLER_SECTIONS = ("model", "lora", "task", "sampling")
LEARNER_SECTIONS = (*SAMPLER_SECTIONS, "algo", "optim")
# sampling keys each peer chooses (how it generates, not what)
PEER_LOCAL = ("backend", "vllm_dtype", "vllm_kv_cache_gib")
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
OPTIM_KEYS = ("steps", "groups_per_step", "lr", "warmup_frac", "lr_schedule", "lr_min_frac", "weight_decay",
              "max_grad_norm")


class RunConfigMismatch(ConfigError):
    """This peer's config differs from the run's; the message lists every differing key with both values."""


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
        sampling={k: v for k, v in cfg.sampling.model_dump().items() if k not in PEER_LOCAL},
        algo=cfg.algo.model_dump(), optim={k: getattr(cfg.train, k) for k in OPTIM_KEYS},
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
