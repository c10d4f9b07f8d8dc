"""Benchmark: bytes a sampler downloads per policy version, full weights (float32, bfloat16) vs LoRA adapters.

    python benchmarks/weight_bytes.py [--rank 16]

Measured: a Qwen2-shaped model with random weights (seed 0) built in-process from a transformers
``Qwen2Config`` (32k vocabulary, hidden 384, 4 layers, 6 heads, 2 key/value heads, MLP 1536, tied
embeddings, about 21M parameters), published exactly as a learner publishes a version
(``p2prl.policy.weights.serialize_weights``): the whole model in float32, the whole model in
bfloat16, and LoRA adapters of rank ``--rank`` on the attention and MLP projections (the default
``model.lora_targets``; adapters stay float32, as peft keeps them, whatever the base's dtype).

Extrapolated: Qwen2.5-0.5B and Qwen3-1.7B, their parameter and adapter tensor counts taken from
models built from their architectures' configs on the meta device (no weights, nothing downloaded);
bytes = parameters x bytes per parameter + tensors x the safetensors header bytes per tensor
measured above. Transfer time = bytes over a 50 and a 500 Mbit/s link (payload only, no protocol
overhead).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

VOCAB = 32_000
LINKS_MBIT = (50, 500)


def architectures():
    from transformers import Qwen2Config, Qwen3Config

    common = dict(tie_word_embeddings=True, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    return {
        "Qwen2.5-0.5B": Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                    num_attention_heads=14, num_key_value_heads=2, **common),
        "Qwen3-1.7B": Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, **common),
    }


def lora(model, rank: int, folder: Path):
    """``model`` with the LoRA adapters a learner would add (``p2prl.policy.model.add_lora``)."""
    from p2prl.config import ModelConfig
    from p2prl.policy.model import add_lora

    return add_lora(model, ModelConfig(lora_rank=rank), folder)


def counts(model) -> tuple[int, int, int, int]:
    """(parameters, tensors, trainable parameters, trainable tensors) of ``model``; tied tensors once."""
    ps = list(model.parameters())
    tr = [p for p in ps if p.requires_grad]
    return sum(p.numel() for p in ps), len(ps), sum(p.numel() for p in tr), len(tr)


def measured(rank: int, folder: Path) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from p2prl.policy.weights import serialize_weights

    hf_logging.disable_progress_bar()

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=384, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(folder)  # the base folder whose hash the adapters carry
    n, tensors, _, _ = counts(model)
    fp32 = len(serialize_weights(model)[0])
    bf16 = len(serialize_weights(Qwen2ForCausalLM(cfg).to(torch.bfloat16))[0])
    peft_model = lora(model, rank, folder)
    _, _, n_lora, lora_tensors = counts(peft_model)
    adapters = len(serialize_weights(peft_model)[0])
    header = (fp32 - 4 * n) / tensors  # safetensors header bytes per tensor
    return {"params": n, "tensors": tensors, "fp32": fp32, "bf16": bf16, "lora_params": n_lora,
            "lora_tensors": lora_tensors, "lora": adapters, "header_per_tensor": header}


def extrapolated(rank: int, folder: Path) -> dict[str, dict]:
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for name, cfg in architectures().items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        n, tensors, _, _ = counts(model)
        _, _, n_lora, lora_tensors = counts(lora(model, rank, folder))
        out[name] = {"params": n, "tensors": tensors, "lora_params": n_lora, "lora_tensors": lora_tensors}
    return out


def fmt_bytes(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB" if b >= 2**20 else f"{b / 2**10:,.1f} KiB"


def fmt_s(s: float) -> str:
    return f"{s:,.1f} s" if s >= 1 else f"{s * 1000:,.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        m = measured(a.rank, Path(tmp))
        ext = extrapolated(a.rank, Path(tmp))
    h = m["header_per_tensor"]
    rows = ["| variant | parameters sent | bytes per version | vs fp32 full |", "|---|---:|---:|---:|"]
    for label, params, size in [("full, float32", m["params"], m["fp32"]), ("full, bfloat16", m["params"], m["bf16"]),
                                (f"LoRA rank {a.rank} (float32 adapters)", m["lora_params"], m["lora"])]:
        rows.append(f"| {label} | {params / 1e6:.2f}M | {fmt_bytes(size)} ({size:,} B) | {size / m['fp32']:.4f} |")
    links = " | ".join(f"at {r} Mbit/s" for r in LINKS_MBIT)
    ext_rows = [f"| model | variant | parameters sent | bytes per version | {links} |",
                "|---|---|---:|---:|" + "---:|" * len(LINKS_MBIT)]
    for name, e in ext.items():
        for label, params, tensors, width in [("full, float32", e["params"], e["tensors"], 4),
                                              ("full, bfloat16", e["params"], e["tensors"], 2),
                                              (f"LoRA rank {a.rank}", e["lora_params"], e["lora_tensors"], 4)]:
            size = params * width + tensors * h
            times = " | ".join(fmt_s(size * 8 / (r * 1e6)) for r in LINKS_MBIT)
            ext_rows.append(f"| {name} | {label} | {params / 1e6:,.1f}M | {fmt_bytes(size)} | {times} |")
    body = f"""Measured on a Qwen2-shaped model with random weights: {m['params'] / 1e6:.1f}M parameters ({m['tensors']} tensors), vocabulary {VOCAB:,}, tied embeddings; each blob is what `serialize_weights` publishes (safetensors + sha256). LoRA on the attention and MLP projections (`model.lora_targets` default), {m['lora_tensors']} adapter tensors.

{chr(10).join(rows)}

Extrapolated from parameter and tensor counts of models built from the architectures' configs on the meta device (Qwen2.5-0.5B: hidden 896, 24 layers, 14/2 heads, MLP 4864; Qwen3-1.7B: hidden 2048, 28 layers, 16/8 heads, head_dim 128, MLP 6144; both vocabulary 151,936, tied): bytes = parameters x bytes per parameter + tensors x {h:.0f} header bytes per tensor (measured above); time = bytes over the link, no protocol overhead.

{chr(10).join(ext_rows)}
"""
    print(body)
    write_section("weight_bytes", "Bytes a sampler downloads per version: full weights vs LoRA adapters",
                  f"python benchmarks/weight_bytes.py --rank {a.rank}", body)


if __name__ == "__main__":
    main()
