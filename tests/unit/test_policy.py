import hashlib

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

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


def _reference_logprobs(model, prompt, prompt_mask, comp, temperature):
    """The straightforward computation: full [B, T, V] logits (float32, or float64 for a float64 model), log_softmax, gather."""
    import torch.nn.functional as F

    ids = torch.cat([prompt, comp], 1)
    attn = torch.cat([prompt_mask, torch.ones_like(comp)], 1)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    logits = logits[:, prompt.shape[1] - 1 : -1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return torch.gather(F.log_softmax(logits, -1), 2, comp.unsqueeze(-1)).squeeze(-1)


def test_chunked_logprobs_match_full_logits_with_gradient():
    """Values in float32 to 1e-5; gradients in float64, where reduction order cannot hide a wrong one."""
    model = load_policy("builtin").model
    g = torch.Generator().manual_seed(0)
    prompt, comp = torch.randint(2, 18, (5, 6), generator=g), torch.randint(0, 18, (5, 7), generator=g)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[0, :3] = prompt_mask[3, :1] = 0
    weights = torch.linspace(-1, 1, 7, dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        model.to(dtype)
        params = list(model.parameters())
        ref = _reference_logprobs(model, prompt, prompt_mask, comp, 0.7)
        ref_grad = torch.autograd.grad((ref * weights).sum(), params)
        for chunk in (18, 18 * 4, 1 << 24):  # one row of logits per chunk, 4 rows, everything at once
            got = sequence_logprobs(model, prompt, prompt_mask, comp, 0.7, chunk_elements=chunk)
            assert got.dtype == torch.promote_types(dtype, torch.float32)
            torch.testing.assert_close(got, ref.to(got.dtype), atol=1e-5, rtol=0)
            if dtype == torch.float64:
                for a, b in zip(torch.autograd.grad((got * weights).sum(), params), ref_grad):
                    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        with torch.no_grad():
            got = sequence_logprobs(model, prompt, prompt_mask, comp, 0.7, chunk_elements=18)
        torch.testing.assert_close(got, ref.detach().to(got.dtype), atol=1e-5, rtol=0)
    model.config.logit_scale = 1.5  # as if logits were more than head(hidden): the whole-logits path, same values
    got = sequence_logprobs(model, prompt, prompt_mask, comp, 0.7, chunk_elements=18)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    for a, b in zip(torch.autograd.grad((got * weights).sum(), params), ref_grad):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_sampler_records_the_full_logits_values_without_keeping_them(builtin_policy):
    """Reference: the earlier implementation (output_logits=True, every step's logits stacked)."""
    import torch.nn.functional as F

    from p2prl.policy.model import left_pad

    tok, model = builtin_policy.tokenizer, builtin_policy.model
    prompts = [tok(p).input_ids for p in ("12+34=", "7+5=", "99+1=")]
    got = generate(builtin_policy, prompts, 4, 6, 0.8, seed=11)
    ids, mask = (t.repeat_interleave(4, 0) for t in left_pad(prompts, builtin_policy.pad_id))
    torch.manual_seed(11)
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                         max_new_tokens=6, eos_token_id=builtin_policy.eos_id, pad_token_id=builtin_policy.pad_id,
                         output_logits=True, return_dict_in_generate=True)
    model.train()
    comp = out.sequences[:, ids.shape[1] :]
    ref = torch.gather(F.log_softmax(torch.stack(out.logits, 1).float() / 0.8, -1), 2, comp.unsqueeze(-1)).squeeze(-1)
    for n, c in enumerate(got):
        rows = slice(4 * n, 4 * n + 4)
        assert (c.tokens[:, : comp.shape[1]] == torch.where(torch.arange(comp.shape[1]) < torch.from_numpy(c.lengths)[:, None],
                                                           comp[rows], builtin_policy.pad_id).numpy()).all()
        for i, length in enumerate(c.lengths):
            torch.testing.assert_close(torch.from_numpy(c.logq[i, :length]), ref[rows][i, :length], atol=1e-5, rtol=0)
            assert (c.logq[i, length:] == 0).all()


def test_cuda_device_without_cuda_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from p2prl.cli import main
    from p2prl.policy.model import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(PolicyLoadError, match="model.device=cuda:1"):
        load_policy("builtin", Config.model_validate({"model": {"device": "cuda:1"}}).model)
    assert main(["train", f"train.out_dir={tmp_path}", "model.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "model.device=cuda" in err and "Traceback" not in err
    with pytest.raises(Exception, match="model.device"):
        Config.model_validate({"model": {"device": "gpu"}})


def test_bfloat16_policy_trains_and_publishes_in_bfloat16(tmp_path):
    from safetensors import safe_open

    from p2prl.learner.core import LearnerCore

    settings = Config.model_validate({"model": {"dtype": "bfloat16", "device": "cpu"}}).model
    policy = load_policy("builtin", settings)
    assert all(p.dtype == torch.bfloat16 for p in policy.model.parameters())
    b = collate(SamplerCore(policy, AdditionTask(), Config(), "run", "s").rollout([0, 1]), policy.pad_id)
    assert sequence_logprobs(policy.model, b["prompt"], b["prompt_mask"], b["completion"], 1.0).dtype == torch.float32
    blob, sha = serialize_weights(policy.model)
    path = tmp_path / "w.safetensors"
    path.write_bytes(blob)
    with safe_open(path, "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    other = load_policy("builtin", settings)
    with torch.no_grad():
        for p in other.model.parameters():
            p.zero_()
    load_weights(other.model, blob)
    assert serialize_weights(other.model)[1] == sha
    f32 = load_policy("builtin")  # a float32 sampler takes bf16 weights, cast exactly
    load_weights(f32.model, blob)
    for p, q in zip(policy.model.parameters(), f32.model.parameters()):
        assert q.dtype == torch.float32 and torch.equal(p.float(), q)
    core = LearnerCore(policy, Config.model_validate({"model": {"dtype": "bfloat16"}}))
    core.step(SamplerCore(policy, AdditionTask(), Config(), "run", "s").rollout([0, 1]))
    assert all(p.dtype == torch.bfloat16 for p in policy.model.parameters())
    assert serialize_weights(policy.model)[1] != sha
    with pytest.raises(ValueError, match="dtype"):
        load_weights(other.model, st_save({k: v.long() for k, v in st_load(blob).items()}))


def test_lag0_mismatch_is_logged_only_for_groups_of_the_current_version(builtin_policy):
    """At lag 0 sampler and learner hold the same weights: the logged mismatch is the engine's, tiny here."""
    import copy

    from p2prl.config import load_config
    from p2prl.learner.core import LearnerCore
    from p2prl.sampler.core import SamplerCore
    from p2prl.tasks import make_task

    cfg = load_config(None, ["sampling.group_size=4"])
    core = LearnerCore(copy.deepcopy(builtin_policy), cfg)
    groups = SamplerCore(builtin_policy, make_task(cfg.task), cfg, "run", "s").rollout([0, 1])
    _, m = core.gradient(groups)
    assert 0 <= m["rollout/lag0_logprob_abs"] < 1e-5 and 0 <= m["rollout/lag0_k3"] < 1e-9
    core.version = 1  # the same groups, now one version old
    _, m = core.gradient(groups)
    assert "rollout/lag0_logprob_abs" not in m and "rollout/lag0_k3" not in m


def test_builtin_smollm2_names_the_fetched_folder_or_says_how_to_fetch_it(tmp_path, monkeypatch):
    from p2prl.policy.model import model_folder
    from p2prl.policy.smollm2 import FETCH_COMMAND

    monkeypatch.setenv("P2PRL_CACHE", str(tmp_path))
    assert model_folder("builtin:smollm2") == tmp_path / "smollm2-135m-instruct"
    with pytest.raises(PolicyLoadError, match=f"not fetched here .*fetch it with: {FETCH_COMMAND}$"):
        load_policy("builtin:smollm2")
