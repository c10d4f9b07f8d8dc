"""A real loopback swarm with one vLLM sampler and one transformers sampler feeding one learner."""

import pytest

from helpers.swarm_util import last_json, read_jsonl, wait_for

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # CI time: tests/vllm/test_backend.py runs the engine (generation, log-probs, reloads)
def test_vllm_and_transformers_samplers_train_one_learner(peers, tmp_path, small_model):
    model = f"model.path={small_model}"
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    # a window no group can fall out of within the test: the vLLM sampler alone can step the learner a few
    # versions a second, so with the default window of 8 the transformers sampler's groups could all arrive
    # stale, depending on the machine's pace
    peers.join("learner", "learner", maddr, model, "train.steps=1000", "staleness.max_staleness=1000", out=out)
    acks = tmp_path / "vllm.acks"  # the groups the vLLM sampler was told are trained
    peers.join("vllm", "sampler", maddr, model, "sampling.backend=vllm", "sampling.vllm_kv_cache_gib=0.25",
               f"testing.ack_log={acks}")

    # the vLLM sampler starts an engine (minutes on 2 shared cores) and loads v0 into it; then the other joins
    wait_for(lambda: "verified)" in peers.log("vllm") or peers.procs["vllm"].poll() is not None, 900,
             "the vLLM sampler to load v0")
    assert peers.procs["vllm"].poll() is None, peers.log("vllm")[-3000:]
    peers.join("hf", "sampler", maddr, model)

    def trained() -> list[tuple[str, int]]:
        return [(gid, v) for l in read_jsonl(out / "train_log.jsonl") for gid, v, _ in l["groups"]]

    def vllm_prefix() -> str | None:
        gids = acks.read_text().split() if acks.exists() else []
        return gids[0].split("/")[0] + "/" if gids else None

    def progressed():
        got, prefix = trained(), vllm_prefix()
        return (prefix is not None and len(read_jsonl(out / "train_log.jsonl")) > 4
                and any(gid.startswith(prefix) and v > 0 for gid, v in got)
                and any(not gid.startswith(prefix) for gid, _ in got))

    wait_for(progressed, 300, "4 versions, groups of both samplers, one the vLLM sampler made with a version > 0")
    assert peers.stop("learner") == 0, peers.log("learner")
    lines = read_jsonl(out / "train_log.jsonl")
    summary = last_json(peers.log("learner"))
    assert [l["version"] for l in lines] == list(range(summary["version"] + 1))
    assert len({gid.split("/")[0] for gid, _ in trained()}) == 2
    assert peers.log("vllm").count("verified)") >= 2, "the vLLM sampler did not load a second version"
    assert "vLLM loaded a version" in peers.log("vllm")
