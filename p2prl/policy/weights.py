"""Policy weights as safetensors bytes with a sha256: the only form weights travel in.

A full policy travels as its whole state. A LoRA policy (``model.lora_rank`` > 0) travels as
its adapter tensors only, named as peft names them in ``adapter_model.safetensors``
(``base_model.model.<module>.lora_A.weight``), with the sha256 of the base model folder in the
file's metadata (``p2prl.base_sha256``): a version is the adapters plus the base they sit on,
and its sha256 covers both.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from p2prl.policy.model import is_lora

BASE_KEY = "p2prl.base_sha256"


def _adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, save_embedding_layers=False)


def serialize_weights(model: torch.nn.Module) -> tuple[bytes, str]:
    """Safetensors bytes of ``model``'s state in its own dtype (tied tensors stored once; a LoRA policy:
    its adapters only) and their sha256."""
    # one metadata key only: safetensors writes a map's keys in no fixed order, and equal weights must give equal bytes
    if is_lora(model):
        own, metadata = _adapter_state(model), {BASE_KEY: model.base_sha256}
    else:
        own, metadata = model.state_dict(), {"format": "pt"}
    state = {}
    seen: dict[int, str] = {}
    for name, t in own.items():
        if t.data_ptr() in seen:  # tied weights (e.g. lm_head = embed_tokens)
            continue
        seen[t.data_ptr()] = name
        state[name] = t.detach().contiguous().cpu()
    blob = st_save(state, metadata=metadata)
    return blob, hashlib.sha256(blob).hexdigest()


def _metadata(blob: bytes) -> dict[str, str]:
    """The metadata map of safetensors ``blob`` (already parsed by ``safetensors.torch.load``: 8-byte
    little-endian header length, then the JSON header)."""
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]).get("__metadata__") or {}


def load_weights(model: torch.nn.Module, blob: bytes) -> None:
    """Load safetensors bytes into ``model``; every parameter must be present with its shape.

    A LoRA policy takes adapter bytes only, made over the same base folder (the metadata's hash).
    Floating tensors of another dtype (a bf16 version into a float32 sampler) are cast on load.
    """
    state = st_load(blob)
    lora = is_lora(model)
    base = _metadata(blob).get(BASE_KEY)
    if lora and base != model.base_sha256:
        raise ValueError(f"adapter weights are for base model {base or 'none (full weights)'}, "
                         f"this policy's base is {model.base_sha256}")
    if not lora and base is not None:
        raise ValueError("weights are LoRA adapters, but this policy has none (model.lora_rank=0)")
    own = _adapter_state(model) if lora else model.state_dict()
    unknown = set(state) - set(own)
    if unknown:
        raise ValueError(f"weights contain unknown tensors: {sorted(unknown)[:5]}")
    for name, t in state.items():
        if t.shape != own[name].shape:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(own[name].shape)}")
        if t.is_floating_point() != own[name].is_floating_point():
            raise ValueError(f"tensor {name} has dtype {t.dtype}, expected {own[name].dtype}")
    missing = [n for n, t in own.items() if n not in state and all(t.data_ptr() != own[m].data_ptr() for m in state)]
    if missing:
        raise ValueError(f"weights lack tensors: {missing[:5]}")
    if lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state)
    else:
        model.load_state_dict(state, strict=False)
