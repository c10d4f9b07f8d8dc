"""The learner's update: rollout groups in, one optimizer step out.

Shared by ``p2prl train`` and swarm learners. Rewards used here are the ones the
verifier recomputed, never a sampler's claim.
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from p2prl.algo import group_advantages
from p2prl.algo.chunks import merge_metrics, pack_units, shuffled_chunks
from p2prl.algo.mismatch import logprob_mismatch
from p2prl.algo.objectives import Objective
from p2prl.learner.checkpoint import load_checkpoint_policy, load_optimizer, read_state
from p2prl.config import Config, TrainConfig
from p2prl.policy import Policy, load_policy, sequence_logprobs
from p2prl.rollout.record import RolloutGroup
from p2prl.policy.weights import load_weights
from p2prl.procs import trim_heap


Row = tuple[np.ndarray, np.ndarray, np.ndarray]  # one completion: prompt ids (P,), tokens (L,), logq (L,)


def group_rows(groups: list[RolloutGroup]) -> list[Row]:
    """The completions of ``groups``, rows grouped by G, unpadded."""
    return [(g.prompt_ids, g.tokens[i, : g.lengths[i]], g.logq[i, : g.lengths[i]])
            for g in groups for i in range(g.group_size)]


def collate_rows(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Stack rows into left-padded prompts and right-padded completions."""
    B, P, T = len(rows), max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    prompt = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    comp = torch.full((B, T), pad_id, dtype=torch.long)
    logq = torch.zeros((B, T))
    mask = torch.zeros((B, T))
    for i, (p, c, q) in enumerate(rows):
        prompt[i, P - len(p) :] = torch.from_numpy(p.astype(np.int64))
        prompt_mask[i, P - len(p) :] = 1
        comp[i, : len(c)] = torch.from_numpy(c.astype(np.int64))
        logq[i, : len(q)] = torch.from_numpy(q)
        mask[i, : len(c)] = 1.0
    return {"prompt": prompt, "prompt_mask": prompt_mask, "completion": comp, "logq": logq, "mask": mask}


def collate(groups: list[RolloutGroup], pad_id: int) -> dict[str, torch.Tensor]:
    """``collate_rows`` of all rows of ``groups``, with their rewards."""
    batch = collate_rows(group_rows(groups), pad_id)
    batch["rewards"] = torch.from_numpy(np.concatenate([g.rewards for g in groups]).astype(np.float32))
    return batch


def rollout_metrics(groups: list[RolloutGroup], rows: list[Row], rewards: torch.Tensor,
                    version: int) -> dict[str, float]:
    """What a step's metrics line says of the groups it trained: reward, completions, lengths, lags, and the tokens the
    update processes (``train/tokens``: prompt + completion tokens of its rows, padding not counted)."""
    return {"rollout/reward": float(rewards.mean()), "rollout/completions": len(rows),
            "rollout/completion_len": float(np.mean([len(r[1]) for r in rows])),  # tokens, EOS included
            "rollout/lag_mean": float(np.mean([version - g.policy_version for g in groups])),
            "rollout/lag_max": float(max(version - g.policy_version for g in groups)),
            "train/tokens": sum(len(r[0]) + len(r[1]) for r in rows)}


def lr_factor(t: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a share of ``t.lr``: linear warmup over
    ``t.warmup_frac`` of the schedule's steps (``t.lr_steps``, else ``t.steps``), then constant, or a cosine from 1
    down to ``t.lr_min_frac`` at its last step, and ``t.lr_min_frac`` after it."""
    span = t.lr_steps or t.steps
    warmup = max(1, round(t.warmup_frac * span))
    if step < warmup:
        return (step + 1) / warmup
    if t.lr_schedule == "constant":
        return 1.0
    done = min(1.0, (step + 1 - warmup) / max(1, span - warmup))
    return t.lr_min_frac + (1.0 - t.lr_min_frac) * 0.5 * (1.0 + math.cos(math.pi * done))


class LearnerCore:
    """Owns the trainable policy, its optimizer and the policy version."""

    def __init__(self, policy: Policy, cfg: Config):
        self.policy, self.cfg = policy, cfg
        self.objective = cfg.algo.objective()
        self.version = 0
        t = cfg.train
        # what is trained, exchanged and stepped: every parameter, or a LoRA policy's adapters
        self.params = [p for p in policy.model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in self.params)
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_factor, t))
        if cfg.model.gradient_checkpointing:
            policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.model.train()

    def loss(self, logp: torch.Tensor, batch: dict[str, torch.Tensor], G: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective on rows whose learner log-probs are ``logp`` (B, T); ``batch`` holds their
        logq, mask and advantages. G: the rows' group size (GEPO scope "batch": the rows the denominator spans)."""
        return self.objective.loss(logp, batch["logq"], batch["mask"], batch["adv"], G)

    def gradient(self, groups: list[RolloutGroup]) -> tuple[torch.Tensor, dict[str, float]]:
        """The flat mean gradient of the loss on ``groups`` (over ``self.params`` in order, float32, cpu).

        The loss is taken per group or, where the objective chunks (GEPO with scope "batch": chunks of
        ``algo.batch_rows`` rows), per chunk of the step's rows shuffled (seeded by the version): each
        chunk is its own denominator, as in the authors' code. With ``train.micro_batch_tokens`` the
        step runs in micro-batches of whole groups / chunks, each loss weighted by its share of rows,
        so the gradient is the one-pass one. Timed: ``time/gradient_s`` (forward and backward passes, wall time);
        ``train/padded_tokens``: the tokens the passes ran on, padding included.
        """
        started = time.perf_counter()
        a, s, model = self.cfg.algo, self.cfg.sampling, self.policy.model
        chunk_rows = self.objective.chunk_rows()
        G = groups[0].group_size
        rows = group_rows(groups)
        rewards = torch.from_numpy(np.concatenate([g.rewards for g in groups]).astype(np.float32))
        adv = group_advantages(rewards, G, a.std_scaling)  # (B,), per group, before any shuffle
        chunked = chunk_rows > 0
        if chunked:
            units = shuffled_chunks(len(rows), chunk_rows, seed=self.cfg.train.seed * 1_000_003 + self.version)
        else:
            units = [list(range(i, i + G)) for i in range(0, len(rows), G)]
        micro = pack_units(units, [len(r[0]) for r in rows], [len(r[1]) for r in rows],
                           self.cfg.train.micro_batch_tokens)
        flat = self._grad_buffer()
        parts = []  # (metrics, rows, masked tokens) per loss call
        fresh = torch.tensor([groups[i // G].policy_version == self.version for i in range(len(rows))])  # lag 0 rows
        mismatch = []  # (mismatch metrics, rows) of lag-0 rows per micro-batch
        padded = 0
        for mb in micro:
            idx = [i for u in mb for i in u]
            batch = collate_rows([rows[i] for i in idx], self.policy.pad_id)
            batch["adv"] = adv[idx]
            batch = {k: v.to(model.device) for k, v in batch.items()}
            padded += batch["prompt"].numel() + batch["completion"].numel()
            logp = sequence_logprobs(model, batch["prompt"], batch["prompt_mask"], batch["completion"],
                                     s.temperature, s.top_k, s.top_p)  # (b, T)
            at0 = fresh[idx].to(model.device)
            if at0.any():  # same weights as the sampler: what is left is the inference engine's mismatch
                mismatch.append((logprob_mismatch(batch["logq"][at0], logp.detach()[at0], batch["mask"][at0].bool()),
                                 int(at0.sum())))
            total, start = 0.0, 0
            for piece in mb if chunked else [idx]:  # one loss per denominator chunk, or one for all the groups
                sl = slice(start, start + len(piece))
                start += len(piece)
                sub = {k: batch[k][sl] for k in ("logq", "mask", "adv")}
                loss, m = self.loss(logp[sl], sub, len(piece) if chunked else G)
                total = total + loss * (len(piece) / len(rows))
                parts.append((m, len(piece), float(sub["mask"].sum()) if self.objective.token_weighted else 0.0))
            total.backward()
        flat = self._concat_grads() if flat is None else flat
        self.optimizer.zero_grad(set_to_none=True)
        m = {f"loss/{k}": v for k, v in merge_metrics(parts).items()}
        m.update(rollout_metrics(groups, rows, rewards, self.version), **{"train/padded_tokens": padded})
        if mismatch:
            n = sum(k for _, k in mismatch)
            m["rollout/lag0_logprob_abs"] = sum(x["abs"] * k for x, k in mismatch) / n
            m["rollout/lag0_k3"] = sum(x["k3"] * k for x, k in mismatch) / n
        flat, m["time/gradient_s"] = flat.float().cpu(), time.perf_counter() - started
        return flat, m

    def _grad_buffer(self) -> torch.Tensor | None:
        """One zeroed flat tensor whose slices become the parameters' gradients, so that the backward passes
        accumulate into the flat gradient (adding to zero is exact: the same bits as ``torch.cat`` of fresh
        gradients) and no second copy of it is ever made; None where the parameters differ in dtype or device."""
        self.optimizer.zero_grad(set_to_none=True)
        if len({(p.dtype, p.device) for p in self.params}) != 1:
            return None
        flat = torch.zeros(self.n_params, dtype=self.params[0].dtype, device=self.params[0].device)
        offset = 0
        for p in self.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

    def _concat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def apply(self, flat_grad: torch.Tensor, *, take: bool = False) -> dict[str, float]:
        """Clip ``flat_grad``, take one optimizer step with it; advances the policy version. Timed:
        ``time/optimizer_s`` (clip and AdamW step, wall time). ``take``: the caller hands ``flat_grad`` over: it
        becomes the parameters' gradient without a copy where its dtype and device are theirs (the clip scales it
        in place), and is emptied after the step, so that no full-size gradient outlives the step (the weights are
        serialized next, beside the versions kept)."""
        started = time.perf_counter()
        offset = 0
        for p in self.params:
            p.grad = flat_grad[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype, copy=not take)
            offset += p.numel()
        metrics = {"loss/grad_norm": float(
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
        )}
        self.optimizer.step()
        if take:
            self.optimizer.zero_grad(set_to_none=True)
            flat_grad.set_()  # its memory goes with the gradients' views
            trim_heap()  # and the step's freed memory: the version's weights are serialized next
        self.scheduler.step()
        self.version += 1
        metrics["policy/version"] = self.version
        metrics["optim/lr"] = self.scheduler.get_last_lr()[0]
        metrics["time/optimizer_s"] = time.perf_counter() - started
        return metrics

    def step(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """One optimizer step on ``groups``; advances the policy version. ``time/update_s``: the update's wall time
        (gradient and optimizer step: no generation, no evaluation)."""
        grad, metrics = self.gradient(groups)
        metrics.update(self.apply(grad, take=True))
        metrics["time/update_s"] = metrics["time/gradient_s"] + metrics["time/optimizer_s"]
        return metrics

    # ---- state shared between learners (weights + optimizer), typed: safetensors + ints ----------
    def optimizer_blob(self) -> bytes:
        """The AdamW state as safetensors bytes (``<index in self.params>.<name>``)."""
        tensors = {}
        for i, p in enumerate(self.params):
            for name, t in self.optimizer.state.get(p, {}).items():
                tensors[f"{i}.{name}"] = t.detach().contiguous().cpu()
        return st_save(tensors)

    def load_state(self, weights: bytes, optimizer: bytes, version: int) -> None:
        """Load a peer's weights (safetensors) and ``optimizer_blob`` bytes at ``version``; validated first."""
        got = st_load(optimizer)
        params = self.params
        state: dict = {}
        for k, t in got.items():
            idx, _, name = k.partition(".")
            if not idx.isdigit() or int(idx) >= len(params) or name not in ("step", "exp_avg", "exp_avg_sq"):
                raise ValueError(f"unexpected optimizer tensor {k!r}")
            p = params[int(idx)]
            if (name == "step" and t.numel() != 1) or (name != "step" and t.shape != p.shape):
                raise ValueError(f"optimizer tensor {k!r} has shape {tuple(t.shape)}")
            state.setdefault(p, {})[name] = t.float().reshape(()) if name == "step" else t.to(p.device, p.dtype)
        if any(len(v) != 3 for v in state.values()):
            raise ValueError("incomplete optimizer state")
        load_weights(self.policy.model, weights)  # validates every tensor before loading any
        self.optimizer.state.clear()
        self.optimizer.state.update(state)
        self.version = version
        self.scheduler.last_epoch = version
        lrs = [base * lam(version) for base, lam in zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.scheduler._last_lr = lrs


def resume_learner(cfg: Config, out: Path) -> tuple[LearnerCore, dict]:
    """The learner at the checkpoint in ``out`` (fresh from ``cfg.model.path`` if none) and its saved state."""
    state = read_state(out, cfg) or {}
    core = LearnerCore(load_checkpoint_policy(out, cfg) if state else load_policy(cfg.model.path, cfg.model), cfg)
    if state:
        load_optimizer(out, core.optimizer, core.scheduler)
        core.version = state["version"]
    return core, state


def progress_line(m: dict[str, float], acc: float, objective: Objective) -> str:
    """The progress-bar summary of one learner step, with the metrics ``objective`` shows."""
    return (f"v{m['policy/version']} reward {m['rollout/reward']:.2f} acc {acc:.3f} {objective.progress(m)} "
            f"lag {m['rollout/lag_mean']:.1f}")
