import hashlib

import pytest
import torch

from p2prl.learner.evaluate import heldout_accuracy
from p2prl.learner.core import collate
from p2prl.policy import PolicyLoadError, load_policy, sequence_logprobs
from p2prl.policy.backends.hf import generate
from p2prl.sampler.core import SamplerCore
from p2prl.config import Config
from p2prl.tasks.addition import AdditionTask
from p2prl.policy.weights import load_weights, serialize_weights


def test_builtin_loads_through_auto_classes(builtin_policy):
    from transformers import PreTrainedModel

    assert isinstance(builtin_policy.model, PreTrainedModel)
    assert builtin_policy.tokenizer("12+34=").input_ids == [builtin_policy.tokenizer.convert_tokens_to_ids(c) for c in "12+34="]
    assert builtin_policy.tokenizer.decode([builtin_policy.tokenizer.convert_tokens_to_ids(c) for c in "46"]) == "46"


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(PolicyLoadError, match="no config.json"):
        load_policy(tmp_path / "nothing-here")


def test_base_checkpoint_leaves_room_for_rl(builtin_policy):
    acc = heldout_accuracy(builtin_policy, AdditionTask(), 512)
    assert 0.10 <= acc <= 0.60, acc


def test_sampler_logprobs_match_learner_recompute(builtin_policy):
    cfg = Config()
    groups = SamplerCore(builtin_policy, AdditionTask(), cfg, "run", "s").rollout([0, 1, 2])
    assert all(g.policy_version == 0 and g.group_size == 8 for g in groups)
    b = collate(groups, builtin_policy.pad_id)
    with torch.no_grad():
        logp = sequence_logprobs(builtin_policy.model, b["prompt"], b["prompt_mask"], b["completion"], 1.0)
    torch.testing.assert_close(logp * b["mask"], b["logq"], atol=1e-4, rtol=0)
    assert (b["mask"].sum(1) >= 1).all()


def test_generation_is_seeded(builtin_policy):
    prompt = builtin_policy.tokenizer("12+34=").input_ids
    a = generate(builtin_policy, [prompt], 8, 5, 1.0, seed=3)[0]
    b = generate(builtin_policy, [prompt], 8, 5, 1.0, seed=3)[0]
    assert a.texts == b.texts and (a.logq == b.logq).all()


def test_weights_roundtrip_and_hash(builtin_policy):
    blob, sha = serialize_weights(builtin_policy.model)
    assert sha == hashlib.sha256(blob).hexdigest()
    other = load_policy("builtin").model
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    load_weights(other, blob)
    assert serialize_weights(other)[1] == sha
    for (n, p), q in zip(builtin_policy.model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(Exception):
        load_weights(other, b"not safetensors")
