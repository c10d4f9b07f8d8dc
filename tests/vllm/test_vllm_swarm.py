"""A real loopback swarm with one vLLM sampler and one transformers sampler feeding one learner."""

from pathlib import Path

import pytest

from helpers.prom_util import free_port, scrape
from helpers.swarm_util import last_json, read_jsonl, wait_for

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
LOADED = "p2prl_sampler_events_total{outcome=loaded,reason=,section=weights}"  # versions a sampler took up


@pytest.mark.slow  # CI time: tests/vllm/test_backend.py runs the engine (generation, log-probs, reloads)
def test_vllm_and_transformers_samplers_train_one_learner_that_learns(peers, tmp_path):
    """The math workload (configs/math.toml: the shipped math base, word problems, GEPO): both samplers' groups
    are trained and the learner's held-out accuracy at v20 is 20 points above the base's (by version, not time:
    the single-process run gains about 50 points in 10 versions)."""
    config = ROOT / "configs" / "math.toml"
    # the config's group size and evaluation over the test defaults (FAST); 8 groups a step, not 16
    math = ["sampling.group_size=8", "train.groups_per_step=8", "task.heldout_size=128", "train.eval_every=10"]
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    # a window no group can fall out of within the test: the vLLM sampler alone can step the learner a few
    # versions a second, so with the default window of 8 the transformers sampler's groups could all arrive
    # stale, depending on the machine's pace
    # both samplers' groups in every step, whatever their pace: the learner waits for the transformers sampler
    # (which joins once the vLLM one holds v0) and needs 8 groups a step, while the vLLM sampler may hold at most
    # 4 not yet trained (it is the faster one: with no bound its fresher groups were picked before the other's
    # for all 20 versions)
    peers.join("learner", "learner", maddr, *math, "train.steps=20", "staleness.max_staleness=1000",
               "train.wait_for_samplers=2", out=out, config=config)
    acks = tmp_path / "vllm.acks"  # the groups the vLLM sampler was told are trained
    port = free_port()  # its metrics count the versions it loads
    peers.join("vllm", "sampler", maddr, *math, "sampling.backend=vllm", "sampling.vllm_kv_cache_gib=0.25",
               "flow.outbox_limit=4", f"testing.ack_log={acks}", f"net.metrics_port={port}", config=config)

    # the vLLM sampler starts an engine (minutes on 2 shared cores) and loads v0 into it; then the other joins
    wait_for(lambda: scrape(port).get(LOADED, 0) >= 1 or peers.procs["vllm"].poll() is not None, 900,
             "the vLLM sampler to load v0")
    assert peers.procs["vllm"].poll() is None, peers.log("vllm")[-3000:]
    peers.join("hf", "sampler", maddr, *math, config=config)

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

    wait_for(lambda: peers.procs["learner"].poll() is not None, 900, "the learner to train its 20 versions")
    assert peers.stop("learner") == 0, peers.log("learner")
    assert progressed(), "no group of both samplers, or none the vLLM sampler made with a version > 0"
    lines = read_jsonl(out / "train_log.jsonl")
    summary = last_json(peers.log("learner"))
    assert summary["version"] == 20 and [l["version"] for l in lines] == list(range(21))
    assert len({gid.split("/")[0] for gid, _ in trained()}) == 2
    assert scrape(port).get(LOADED, 0) >= 2, "the vLLM sampler did not load a second version"
    assert "vLLM loaded a version" in peers.log("vllm")
    assert summary["final_acc"] >= summary["base_acc"] + 0.2, summary
