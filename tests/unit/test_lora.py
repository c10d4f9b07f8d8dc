"""LoRA policies (model.lora_rank > 0): learners train adapters, versions are adapter bytes over a hashed base."""

import hashlib

import pytest
import torch
from safetensors.torch import load as st_load

from p2prl.config import Config, ConfigError, load_config
from p2prl.learner.core import LearnerCore, collate
from p2prl.policy import PolicyLoadError, load_policy, sequence_logprobs
from p2prl.policy.backends.hf import HFGenerator
from p2prl.policy.model import model_hash
from p2prl.policy.weights import BASE_KEY, _metadata, load_weights, serialize_weights
from p2prl.sampler.core import SamplerCore
from p2prl.trust.runconfig import SAMPLER_SECTIONS, differences, run_config
from p2prl.tasks.addition import AdditionTask

G = 4


def lora_cfg(*extra: str) -> Config:
    return load_config(None, ["model.lora_rank=4", f"sampling.group_size={G}", "train.lr=1e-2", *extra])


@pytest.fixture(scope="module")
def trained():
    """A LoRA learner after two steps on real rollouts of its own policy (lora_B starts at zero, so
    lora_A first gets a gradient in the second step), and the state it started from."""
    cfg = lora_cfg()
    core = LearnerCore(load_policy("builtin", cfg.model), cfg)
    before = {n: p.detach().clone() for n, p in core.policy.model.named_parameters()}
    sampler = SamplerCore(load_policy("builtin", cfg.model), AdditionTask(), cfg, "run", "s")
    for step in range(2):
        blob, sha = serialize_weights(core.policy.model)
        sampler.load(blob, core.version, sha)
        core.step(sampler.rollout(list(range(step * 6, step * 6 + 6))))
    return cfg, core, before


def test_only_the_adapters_are_trainable_and_exchanged():
    cfg = lora_cfg()
    core = LearnerCore(load_policy("builtin", cfg.model), cfg)
    names = [n for n, p in core.policy.model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(core.params) == len(names) == 2 * 7 * 2  # A and B on 7 projections in 2 layers
    assert core.n_params == sum(p.numel() for p in core.params) < sum(p.numel() for p in core.policy.model.parameters()) / 5
    full = LearnerCore(load_policy("builtin"), Config())
    assert full.params == list(full.policy.model.parameters())  # LoRA off: every parameter, as before


def test_a_step_changes_every_adapter_and_no_base_parameter(trained):
    _, core, before = trained
    assert core.version == 2
    for n, p in core.policy.model.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, before[n]), f"adapter {n} did not change"
        else:
            assert torch.equal(p, before[n]), f"base parameter {n} changed"


def test_published_version_is_the_adapters_over_the_base_hash(trained):
    cfg, core, _ = trained
    blob, sha = serialize_weights(core.policy.model)
    assert sha == hashlib.sha256(blob).hexdigest()
    tensors = st_load(blob)
    assert set(tensors) == {n.replace(".default", "") for n, p in core.policy.model.named_parameters() if p.requires_grad}
    assert all(t.dtype == torch.float32 for t in tensors.values())
    full = serialize_weights(load_policy("builtin").model)[0]
    assert len(blob) < len(full) / 5
    assert _metadata(blob) == {BASE_KEY: model_hash("builtin")}
    again = LearnerCore(load_policy("builtin", cfg.model), cfg)
    load_weights(again.policy.model, blob)
    assert serialize_weights(again.policy.model) == (blob, sha)  # same bytes for the same adapters


def test_sampler_loading_the_adapters_reproduces_the_learner_logprobs(trained):
    cfg, core, _ = trained
    blob, sha = serialize_weights(core.policy.model)
    sampler = SamplerCore(load_policy("builtin", cfg.model), AdditionTask(), cfg, "run", "s")
    sampler.load(blob, core.version, sha)  # HFGenerator.load: adapter bytes only
    groups = sampler.rollout([100, 101, 102])
    b = collate(groups, core.policy.pad_id)
    with torch.no_grad():
        logp = sequence_logprobs(core.policy.model, b["prompt"], b["prompt_mask"], b["completion"], cfg.sampling.temperature)
        base = sequence_logprobs(load_policy("builtin").model, b["prompt"], b["prompt_mask"], b["completion"], 1.0)
    torch.testing.assert_close(logp * b["mask"], b["logq"], atol=1e-5, rtol=0)
    assert float(((base - logp).abs() * b["mask"]).max()) > 1e-3, "the adapters changed nothing: the check is void"


def test_adapters_load_only_onto_their_base_and_rank(trained, tmp_path):
    cfg, core, _ = trained
    blob = serialize_weights(core.policy.model)[0]
    with pytest.raises(ValueError, match="LoRA adapters, but this policy has none"):
        load_weights(load_policy("builtin").model, blob)
    lora = load_policy("builtin", cfg.model).model
    with pytest.raises(ValueError, match="full weights"):
        load_weights(lora, serialize_weights(load_policy("builtin").model)[0])
    with pytest.raises(ValueError, match="shape"):
        load_weights(load_policy("builtin", lora_cfg("model.lora_rank=2").model).model, blob)
    lora.base_sha256 = "0" * 64  # adapters of another base folder
    with pytest.raises(ValueError, match="base model"):
        load_weights(lora, blob)
    HFGenerator(load_policy("builtin", cfg.model)).load(blob)  # and the right one loads


def test_lora_settings_are_part_of_the_run_config_and_the_checkpoint_identity():
    task = AdditionTask()
    on, off = run_config(lora_cfg(), task), run_config(Config(), task)
    assert off.lora == {"lora_rank": 0} and on.lora["lora_rank"] == 4 and "q_proj" in on.lora["lora_targets"]
    assert "lora" in SAMPLER_SECTIONS
    assert any(d.startswith("lora.lora_rank:") for d in differences(on, off, SAMPLER_SECTIONS))
    assert lora_cfg().run_identity()["model"]["lora_rank"] == 4
    assert lora_cfg().run_identity() != lora_cfg("model.lora_alpha=8").run_identity()


def test_bad_lora_settings_are_clear_errors():
    with pytest.raises(PolicyLoadError, match="model.lora_targets"):
        load_policy("builtin", lora_cfg("model.lora_targets=['nonexistent_proj']").model)
    with pytest.raises(ConfigError, match="model.lora_rank"):
        load_config(None, ["model.lora_rank=-1"])
    with pytest.raises(ConfigError, match="model.lora_targets"):
        load_config(None, ["model.lora_targets=[]"])
