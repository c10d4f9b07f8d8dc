"""A tiny GGUF model file written with the ``gguf`` package's writer: a llama-architecture model (2 layers,
hidden 64, head_dim 32) with random float32 weights and a byte-level BPE tokenizer (256 byte tokens, two merges and the
ChatML markers), as llama.cpp's converter lays such a file out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 2, 1


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: one printable character per byte, as byte-level BPE vocabularies spell
    bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, architecture: str = "llama", chat_template: bool = True, seed: int = 0) -> Path:
    """Write the tiny model to ``path`` (a ``.gguf`` file) and return it. ``architecture`` other than llama writes
    the same tensors under another ``general.architecture`` (for refusals)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = _byte_tokens() + ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-test-model")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * 258 + [gguf.TokenType.CONTROL] * 2)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(CHATML)
    head_dim = HIDDEN // HEADS

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (scale * rng.standard_normal(shape)).astype(np.float32))

    t("token_embd.weight", vocab, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    t("output.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        t(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        t(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        t(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        t(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        t(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
