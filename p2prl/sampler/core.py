"""The sampler's half: generate groups with the policy version it holds, score them, tag them."""

from __future__ import annotations

import hashlib
import time

import numpy as np

from p2prl.config import Config
from p2prl.policy import Policy
from p2prl.policy.backends.base import Generator
from p2prl.policy.backends.hf import HFGenerator
from p2prl.rollout.record import RolloutGroup
from p2prl.rollout.verify import assigned_prompt_id
from p2prl.tasks import Task, render_prompt


class SamplerCore:
    def __init__(self, policy: Policy, task: Task, cfg: Config, run_id: str, peer_id: str, session: str = "",
                 generator: Generator | None = None):
        """Group ids are ``<peer_id>/<session>/<n>``: unique across restarts when ``session`` is fresh."""
        self.policy, self.task, self.cfg = policy, task, cfg
        self.generator = generator or HFGenerator(policy)
        self.run_id, self.peer_id = run_id, peer_id
        self.prefix = f"{peer_id}/{session}" if session else peer_id
        self.version, self.weights_sha256 = 0, ""
        self.groups_made = 0
        self.generation_s = 0.0  # seconds spent generating and scoring groups

    def load(self, blob: bytes | bytearray, version: int, sha256: str) -> None:
        """Load verified safetensors weights for ``version`` into the generation model (the safetensors
        parser takes ``bytes``: a fetched buffer is copied for the load only)."""
        self.generator.load(blob if isinstance(blob, bytes) else bytes(blob))
        self.version, self.weights_sha256 = version, sha256

    def _seed(self) -> int:
        h = hashlib.blake2b(f"{self.cfg.train.seed}:{self.prefix}:{self.groups_made}".encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF

    def own_prompt_ids(self, n: int) -> list[int]:
        """The prompt ids the run assigns to this sampler's next ``n`` groups (swarm samplers: learners check them)."""
        return [assigned_prompt_id(self.cfg.task.seed, self.prefix, i)
                for i in range(self.groups_made, self.groups_made + n)]

    def rollout(self, prompt_ids: list[int]) -> list[RolloutGroup]:
        """One group per prompt id, all generated with the current version."""
        s, t0 = self.cfg.sampling, time.perf_counter()
        problems = [self.task.problem(i) for i in prompt_ids]
        prompts = [render_prompt(self.policy.tokenizer, self.task, p) for p in problems]
        comps = self.generator.generate(prompts, s.group_size, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                                        seed=self._seed())
        groups = []
        for prob, c in zip(problems, comps):
            groups.append(
                RolloutGroup(
                    group_id=f"{self.prefix}/{self.groups_made}",
                    run_id=self.run_id,
                    prompt_id=prob.prompt_id,
                    policy_version=self.version,
                    weights_sha256=self.weights_sha256,
                    prompt_ids=c.prompt_ids,
                    tokens=c.tokens,
                    lengths=c.lengths,
                    logq=c.logq,
                    rewards=np.array([self.task.score(prob, t) for t in c.texts], dtype=np.float32),
                    sampler=self.peer_id,
                )
            )
            self.groups_made += 1
        self.generation_s += time.perf_counter() - t0
        return groups
