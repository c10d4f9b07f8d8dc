"""The run's config: fingerprints, differences and the checks at join (no network)."""

import shutil

import pytest

from p2prl.config import Config, ConfigError, load_config, writable_dir
from p2prl.policy.model import BUILTIN_MODEL, model_hash
from p2prl.net.dht import RunConfigRecord
from p2prl.trust.runconfig import RunConfigMismatch, check, run_config
from p2prl.tasks import make_task


def config(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def record(*overrides: str) -> RunConfigRecord:
    cfg = config(*overrides)
    return run_config(cfg, make_task(cfg.task))


def test_model_hash_follows_the_files(tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, copy)
    assert model_hash(str(copy)) == model_hash("builtin")
    (copy / "generation_config.json").write_text("{}")  # decoding defaults do not count
    assert model_hash(str(copy)) == model_hash("builtin")
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_hash(str(copy)) != model_hash("builtin")


def test_record_round_trips_through_its_wire_form():
    rec = record()
    assert RunConfigRecord.decode(rec.encode()) == rec
    assert RunConfigRecord.decode(b"\x00" * 10) is None
    assert RunConfigRecord.decode(b"x" * (RunConfigRecord.MAX_BYTES + 1)) is None


def test_a_sampler_with_another_group_size_is_refused_with_both_values():
    with pytest.raises(RunConfigMismatch) as e:
        check({"learner-peer-abcdef": record()}, record("sampling.group_size=4"), "sampler", "r")
    msg = str(e.value)
    assert "sampling.group_size: the run has 8, this peer has 4" in msg and "abcdef" in msg


def test_samplers_share_model_task_and_sampling_learners_also_algo_and_optim():
    run = {"l": record()}
    check(run, record("algo.name=gspo", "train.lr=0.1"), "sampler", "r")  # a sampler does not use them
    for override, key in [("algo.name=gspo", "algo.name"), ("train.lr=0.1", "optim.lr")]:
        with pytest.raises(RunConfigMismatch, match=key):
            check(run, record(override), "learner", "r")
    with pytest.raises(RunConfigMismatch, match="task: the run has 'addition:digits=2"):
        check(run, record("task.digits=3"), "sampler", "r")
    check(run, record(), "learner", "r")
    check(run, record("sampling.backend=vllm", "sampling.vllm_kv_cache_gib=0.25", "sampling.vllm_dtype=bfloat16"),
          "sampler", "r")  # how a peer generates is its own choice
    check({}, record("sampling.group_size=4"), "sampler", "r")  # no learner yet: nothing to compare


def test_learners_of_a_run_agree_on_skipping_uniform_groups_samplers_need_not():
    run = {"l": record()}
    assert record().flow == {"skip_uniform_groups": True}
    check(run, record("flow.skip_uniform_groups=false"), "sampler", "r")
    with pytest.raises(RunConfigMismatch, match="flow.skip_uniform_groups: the run has True, this peer has False"):
        check(run, record("flow.skip_uniform_groups=false"), "learner", "r")
    check(run, record("flow.max_learner_queue=32"), "learner", "r")  # how a learner paces its queue is its own
    old = record().model_copy(update={"flow": {}})  # from before the section (a run record signed then)
    assert RunConfigRecord.decode(old.encode()).flow == {}
    check({"l": old}, record("flow.skip_uniform_groups=false"), "learner", "r")


def test_group_size_one_is_refused():
    with pytest.raises(ConfigError, match="group_size=1.*always zero"):
        config("sampling.group_size=1")


def test_unwritable_out_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="train.out_dir='.*file/run' is not a writable folder"):
        writable_dir(blocker / "run", "train.out_dir")
    assert writable_dir(tmp_path / "a" / "b", "train.out_dir").is_dir()


def test_a_different_model_is_named_by_both_folders(tmp_path):
    copy = tmp_path / "my-model"
    shutil.copytree(BUILTIN_MODEL, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    run, mine = record(), record(f"model.path={copy}")
    with pytest.raises(RunConfigMismatch) as e:
        check({"learner-peer-abcdef": run}, mine, "sampler", "r")
    line = str(e.value).splitlines()[1].strip()
    assert line == (f"model: the run's learner loaded 'builtin' (sha256 {run.model[:12]}), this peer loaded "
                    f"{str(copy)!r} (sha256 {mine.model[:12]}): their weights, tokenizer or model config differ "
                    "(use a copy of the run's model folder)")
    shutil.copy(BUILTIN_MODEL / "model.safetensors", weights)  # the same files under another name: the same model
    check({"l": run}, record(f"model.path={copy}"), "learner", "r")
