"""Policy weights as safetensors bytes with a sha256: the only form weights travel in."""

from __future__ import annotations

import hashlib

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def serialize_weights(model: torch.nn.Module) -> tuple[bytes, str]:
    """Safetensors bytes of ``model``'s state in its own dtype (tied tensors stored once) and their sha256."""
    state = {}
    seen: dict[int, str] = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:  # tied weights (e.g. lm_head = embed_tokens)
            continue
        seen[t.data_ptr()] = name
        state[name] = t.detach().contiguous().cpu()
    blob = st_save(state, metadata={"format": "pt"})
    return blob, hashlib.sha256(blob).hexdigest()


def load_weights(model: torch.nn.Module, blob: bytes) -> None:
    """Load safetensors bytes into ``model``; every parameter must be present with its shape.

    Floating tensors of another dtype (a bf16 version into a float32 sampler) are cast on load.
    """
    state = st_load(blob)
    own = model.state_dict()
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
    model.load_state_dict(state, strict=False)
