"""Loading a policy from a local folder and computing per-token log-probs.

Everything goes through ``AutoModelForCausalLM`` / ``AutoTokenizer``, so the built-in
tiny model and any Hugging Face model folder load the same way (a ``.gguf`` file, through the
plain folder it is imported into: ``p2prl.policy.gguf``). Nothing is downloaded: loading is
``local_files_only``.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.utils.checkpoint

from p2prl.config import ModelConfig
from p2prl.policy import smollm2
from p2prl.policy.gguf import GGUFError, gguf_folder

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUILTIN_MODEL = ASSETS / "base"
MATH_MODEL = ASSETS / "math-base"  # python -m p2prl.policy.make_base --task math
BUILTIN_MODELS = {"builtin": BUILTIN_MODEL, "builtin:addition-scratchpad": ASSETS / "addition-scratchpad",
                  "builtin:math": MATH_MODEL}
BUILTIN_MODELS["builtin:smollm2"] = smollm2.folder()  # resolved again by model_folder, under $P2PRL_CACHE


def model_folder(path: str | Path) -> Path:
    """The folder ``model.path`` names: a shipped base (``builtin``: the addition task's;
    ``builtin:addition-scratchpad``: the scratchpad task's; ``builtin:math``: the word problems'; ``builtin:smollm2``:
    SmolLM2-135M-Instruct's import, made by ``python -m p2prl.policy.smollm2``),
    a local folder, or a ``.gguf`` file (its import into the cache, made on first use: ``gguf.gguf_folder``).
    A ``builtin:`` name that is none of these is refused with the list."""
    if str(path).startswith("builtin:") and str(path) not in BUILTIN_MODELS:
        raise PolicyLoadError(f"model.path={str(path)!r}: no such built-in model; the built-in ones are "
                              + ", ".join(repr(k) for k in BUILTIN_MODELS))
    if str(path).lower().endswith(".gguf"):
        try:
            return gguf_folder(path)
        except GGUFError as e:
            raise PolicyLoadError(f"model.path={str(path)!r}: {e}") from e
    if str(path) == "builtin:smollm2":
        return smollm2.folder()  # where $P2PRL_CACHE says now
    return BUILTIN_MODELS.get(str(path)) or Path(path).expanduser()


# files that decide what a model folder computes (weights, architecture, tokenizer, chat template)
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


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
    """sha256 over the files of a model folder (``builtin`` = the shipped model) that decide what it computes:
    the run config's model (``p2prl.trust.runconfig``) and the base a LoRA adapter sits on (``add_lora``)."""
    folder = model_folder(path).resolve()
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.iterdir()) if f.is_file())
    return _folder_hash(folder, stamp)


class PolicyLoadError(RuntimeError):
    """A model that cannot be loaded as configured: folder missing or unreadable, device absent."""


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``model.device`` as a torch device: auto = cuda if available, else cpu; cuda without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PolicyLoadError(f"model.device={name}, but torch sees no CUDA device here; "
                                  "use model.device=cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise PolicyLoadError(f"model.device={name}, but this machine has {torch.cuda.device_count()} "
                                  "CUDA device(s)")
    return dev


def preload(path: str | Path) -> None:
    """Import what loading the model at ``path`` will import, without loading it: transformers imports
    its auto classes and each architecture's modules lazily, seconds of CPU that a process forking
    several peers (``p2prl swarm up``) pays once here instead of once per peer. Problems with the
    folder are left to the peers' own loads, which report them."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    for name in ("AutoModelForCausalLM", "AutoTokenizer"):  # an attribute of transformers is a lazy import
        getattr(transformers, name)
    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_folder(path), local_files_only=True))]
    except Exception:
        pass


def load_policy(path: str | Path, settings: ModelConfig | None = None) -> Policy:
    """Load model and tokenizer from a local folder (``"builtin"`` = the shipped tiny model; see ``model_folder``).

    ``settings`` (the config's ``model`` section) gives the device and dtype; None = cpu, float32.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    device = resolve_device(settings.device) if settings else torch.device("cpu")
    dtype = DTYPES[settings.dtype] if settings else torch.float32
    hf_logging.disable_progress_bar()
    folder = model_folder(path)
    if folder == MATH_MODEL and not (folder / "config.json").is_file():
        raise PolicyLoadError(f"model.path={str(path)!r}: the math base is not built in this checkout ({folder}); "
                              "build it with: python -m p2prl.policy.make_base --task math")
    if str(path) == "builtin:smollm2" and not (folder / "config.json").is_file():
        raise PolicyLoadError(f"model.path='builtin:smollm2': SmolLM2-135M-Instruct is not fetched here ({folder}); "
                              f"fetch it with: {smollm2.FETCH_COMMAND}")
    if not (folder / "config.json").is_file():
        raise PolicyLoadError(
            f"model folder {folder} has no config.json; pass a local Hugging Face model "
            "folder (containing config.json, weights and tokenizer files), a .gguf file or a shipped one: "
            + ", ".join(repr(k) for k in BUILTIN_MODELS)
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as e:
        raise PolicyLoadError(f"could not load a causal LM from {folder}: {e}") from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if settings and settings.lora_rank:
        model = add_lora(model, settings, folder)
    return Policy(model=model.to(device), tokenizer=tokenizer)


LORA_INIT_SEED = 0
"""Seed of the adapters' initialisation: every learner of a run starts from the same version 0."""


def add_lora(model: torch.nn.Module, settings: ModelConfig, folder: Path) -> torch.nn.Module:
    """``model`` wrapped with peft LoRA adapters as ``settings`` says; only the adapters are trainable.

    The adapters are initialised from a fixed seed (lora_B is zero, so version 0 computes what
    the base does) and remember the sha256 of the base folder they sit on (``base_sha256``),
    which every serialized adapter carries.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                        target_modules=list(settings.lora_targets), bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(LORA_INIT_SEED)
        try:
            model = get_peft_model(model, config)
        except ValueError as e:  # e.g. no module of the model is named like a target
            raise PolicyLoadError(f"model.lora_targets={list(settings.lora_targets)} do not fit the model in "
                                  f"{folder}: {e}") from e
    model.base_sha256 = model_hash(str(folder))
    return model


def is_lora(model: torch.nn.Module) -> bool:
    """True for a policy model wrapped with LoRA adapters (``add_lora``)."""
    peft = sys.modules.get("peft")  # never imported: no model is wrapped
    return peft is not None and isinstance(model, peft.PeftModel)


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself: the base of a LoRA policy (with the adapters in its layers), else ``model``."""
    return model.get_base_model() if is_lora(model) else model


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as a left-padded batch: (ids, attention mask), both (N, P) long."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
    return ids, mask


LOGITS_CHUNK = 1 << 24
"""Most float32 logits one chunk of ``sequence_logprobs`` holds at once (64 MiB)."""

_POST_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of models whose logits are more than the output embedding of the final hidden state."""


def _completion_states(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                       completion_ids: torch.Tensor, chunk_elements: int):
    """(hidden, head, rows): the (B*T, H) final hidden states at the positions that predict completion tokens (or
    the whole logits, with ``head`` None, for models whose logits are more than ``head(hidden)``) and how many
    rows of logits fit ``chunk_elements``."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
    attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    P = prompt_ids.shape[1]
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    config = model.config.get_text_config()
    if decoder is model or head is None or any(getattr(config, k, None) not in (None, 1, 1.0) for k in _POST_HEAD):
        # logits are not head(hidden): take them whole from the model
        hidden, head = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits, None
    else:
        hidden = decoder(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).last_hidden_state
    hidden = hidden[:, P - 1 : -1]  # (B, T, H or V) at the positions that predict completion tokens
    flat = hidden.reshape(completion_ids.numel(), -1)
    rows = max(1, chunk_elements // (config.vocab_size if head is not None else flat.shape[1]))  # logits rows per chunk
    return flat, head, rows


def sequence_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_elements: int = LOGITS_CHUNK,
) -> torch.Tensor:
    """Per-token log-probs of ``completion_ids`` under the distribution sampling from ``model`` at (``temperature``,
    ``top_k``, ``top_p``) draws from: the tempered logits' softmax, truncated to the tokens top-k then top-p keep
    (``truncation``) and renormalised over them (``behaviour_logprob``: the token itself always counts as kept).

    prompt_ids, prompt_mask: (B, P), left-padded. completion_ids: (B, T).
    Returns (B, T), float32 (float64 for a float64 model); positions past a completion's end
    are meaningless (mask them).

    The [B, T, V] logits are never held at once: the decoder's final hidden states are
    computed once, and the output embedding + log-softmax run over chunks of at most
    ``chunk_elements`` logits, each recomputed in the backward pass (activation
    checkpointing), so the result stays exactly differentiable.
    """
    flat, head, rows = _completion_states(model, prompt_ids, prompt_mask, completion_ids, chunk_elements)
    B, T = completion_ids.shape
    tokens = completion_ids.reshape(B * T)
    checkpoint = torch.is_grad_enabled() and flat.requires_grad
    truncated = top_k > 0 or top_p < 1.0

    def chunk(h: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        logits = head(h) if head is not None else h  # (n, V)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        if truncated:
            return behaviour_logprob(logits, tok, top_k, top_p)
        return logits.gather(1, tok.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=1)  # (n,)

    out = []
    for i in range(0, B * T, rows):
        h, tok = flat[i : i + rows], tokens[i : i + rows]
        out.append(torch.utils.checkpoint.checkpoint(chunk, h, tok, use_reentrant=False) if checkpoint
                   else chunk(h, tok))
    return torch.cat(out).view(B, T)


SUPPORT_SLACK = 0.25
"""Nats below the least likely token a top-k / top-p truncation keeps within which a token still counts as in the
support (an honest sampler in another dtype or engine draws near the cut-off too)."""

SAMPLING_CLIP = 4.0
"""Bound (nats) on each token's surprise term in ``sampling_stats``: one rare token cannot decide a test."""


@torch.no_grad()
def sampling_stats(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   completion_ids: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   clip: float = SAMPLING_CLIP, chunk_elements: int = LOGITS_CHUNK) -> dict[str, torch.Tensor]:
    """What sampling from ``model`` at (``temperature``, ``top_k``, ``top_p``) makes of each completion token, as
    (B, T) float32 tensors. ``logp``: the token's log-prob under the distribution it was drawn from (as
    ``sequence_logprobs``: the token always counts as kept). With pi the
    truncated, renormalised distribution the token was drawn from, H its entropy and f(x) = clamp(log pi(x) + H,
    -clip, clip) (how much likelier than typical x is): ``term`` = f(x_t) - E_pi[f] (-inf for a token outside pi's
    support, ``SUPPORT_SLACK`` allowed) and ``variance`` = Var_pi[f]. Drawn honestly, ``term`` has mean 0 and that
    variance given the prefix, and lies in [-2 clip, 2 clip]. ``top`` = max pi, and ``mode`` = [x_t is pi's most
    likely token] - ``top``: drawn honestly, a Bernoulli(``top``) centred on its mean given the prefix; greedy text
    makes it positive at every token, which a confident model's surprise hardly shows. Arguments as
    ``sequence_logprobs``."""
    flat, head, rows = _completion_states(model, prompt_ids, prompt_mask, completion_ids, chunk_elements)
    B, T = completion_ids.shape
    tokens = completion_ids.reshape(B * T)
    out: dict[str, list[torch.Tensor]] = {"logp": [], "term": [], "variance": [], "mode": [], "top": []}
    for i in range(0, B * T, rows):
        logits = head(flat[i : i + rows]) if head is not None else flat[i : i + rows]
        logp = torch.log_softmax(logits.float() / temperature, dim=1)  # (n, V)
        kept = truncation(logp, top_k, top_p)
        norm = torch.logsumexp(logp.masked_fill(~kept, -torch.inf), 1, keepdim=True)  # log of the kept mass
        logpi = torch.where(kept, logp - norm, -torch.inf)
        pi = logpi.exp()
        entropy = -(pi * torch.where(kept, logpi, 0.0)).sum(1, keepdim=True)
        f = torch.where(kept, (logpi + entropy).clamp(-clip, clip), 0.0)
        mean = (pi * f).sum(1)
        chosen = logp.gather(1, tokens[i : i + rows, None]).squeeze(1)
        floor = logp.masked_fill(~kept, torch.inf).min(1).values - SUPPORT_SLACK  # the least likely kept, less slack
        f_chosen = (chosen - norm[:, 0] + entropy[:, 0]).clamp(-clip, clip)
        if top_k > 0 or top_p < 1.0:
            in_kept = kept.gather(1, tokens[i : i + rows, None]).squeeze(1)
            out["logp"].append(torch.where(in_kept, chosen - norm[:, 0], chosen - torch.logaddexp(norm[:, 0], chosen)))
        else:
            out["logp"].append(chosen)
        out["term"].append(torch.where(chosen >= floor, f_chosen - mean, -torch.inf))
        out["variance"].append(((pi * f**2).sum(1) - mean**2).clamp(min=0.0))
        top, mode = pi.max(1)
        out["mode"].append((tokens[i : i + rows] == mode).float() - top)
        out["top"].append(top)
    return {k: torch.cat(v).view(B, T) for k, v in out.items()}


def behaviour_logprob(logits: torch.Tensor, tokens: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(n,) log-prob of ``tokens`` (n,) under the (n, V) tempered ``logits`` truncated by top-k then top-p and
    renormalised: the distribution a sampler with those settings draws from. The token itself always counts as kept,
    so a token the truncation would drop (drawn by a sampler whose weights, dtype or engine differ) gets its mass
    over the kept tokens and itself, finite, not -inf. The kept set is a constant of the gradient."""
    with torch.no_grad():
        kept = truncation(torch.log_softmax(logits, dim=1), top_k, top_p)
        kept.scatter_(1, tokens.unsqueeze(1), True)
    return logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits.masked_fill(~kept, -torch.inf), 1)


def truncation(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(n, V) bool: the tokens top-k then top-p sampling keeps (transformers' warpers: ties at the k-th value kept;
    the smallest set of most likely tokens whose probability reaches ``top_p``, at least one)."""
    kept = torch.ones_like(logp, dtype=torch.bool)
    if 0 < top_k < logp.shape[1]:
        kept &= logp >= logp.topk(top_k, dim=1).values[:, -1:]
    if top_p < 1.0:
        masked = logp.masked_fill(~kept, -torch.inf)
        sorted_, order = masked.sort(dim=1)  # ascending
        probs = torch.softmax(sorted_, dim=1)
        drop = probs.cumsum(1) <= 1.0 - top_p
        drop[:, -1] = False  # the most likely token always stays
        kept &= ~drop.scatter(1, order, drop)
    return kept
