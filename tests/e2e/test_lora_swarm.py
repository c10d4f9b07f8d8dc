"""A real loopback swarm with LoRA: the learner publishes adapters, samplers load them per version."""

import pytest

from helpers.swarm_util import Peers, last_json, read_jsonl, wait_for

LORA = ("model.lora_rank=4", "train.lr=1e-2")


@pytest.fixture
def peers(tmp_path):
    p = Peers(tmp_path)
    yield p
    p.close()


@pytest.mark.slow
def test_lora_swarm_trains_adapters_and_refuses_a_full_weight_sampler(peers, tmp_path):
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    peers.join("learner", "learner", maddr, "train.steps=1000", *LORA, out=out)
    peers.join("s0", "sampler", maddr, *LORA)

    def progressed():  # the sampler loaded a newer adapter and a group made with it was trained
        lines = read_jsonl(out / "train_log.jsonl")
        return len(lines) > 4 and any(v for l in lines for _, v, _ in l["groups"])

    wait_for(progressed, 300, "4 LoRA versions trained, one on a group from a newer version")
    full = peers.join("s1", "sampler", maddr)  # no adapters: another run config
    assert full.wait(timeout=120) == 2, peers.log("s1")
    assert "lora.lora_rank: the run has 4, this peer has 0" in peers.log("s1")
    assert peers.stop("learner") == 0, peers.log("learner")
    summary = last_json(peers.log("learner"))
    lines = read_jsonl(out / "train_log.jsonl")
    published = {l["version"]: l["published"] for l in lines}
    tags = [(v, sha) for l in lines for _, v, sha in l["groups"]]
    assert tags and all(published[v] == sha for v, sha in tags)
    # the checkpoint and every upload are the adapters (one fixed size; the full builtin weights are ~10x larger)
    adapter = (out / "checkpoint" / "adapter.safetensors").stat().st_size
    assert not list((out / "checkpoint").glob("model*.safetensors"))
    served = summary["weights_bytes_served"]
    assert served > 0 and served % adapter == 0, (served, adapter)
