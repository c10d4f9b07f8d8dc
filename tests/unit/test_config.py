import re

import pytest

from p2prl.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nsteps = 7\n[algo]\nname = 'grpo'\n")
    cfg = load_config(f, ["algo.scope=batch", "train.lr=0.5", "staleness.delay=fixed"])
    assert cfg.train.steps == 7 and cfg.algo.name == "grpo" and cfg.algo.scope == "batch"
    assert cfg.train.lr == 0.5 and cfg.staleness.delay == "fixed"
    assert cfg.algo.std_scaling is True
    assert load_config(None, ["algo.name=gepo"]).algo.std_scaling is False


def test_shipped_configs_validate():
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.toml"))
    assert files
    for f in files:
        load_config(f)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.stepz=3", "train.stepz"),
        ("bogus.x=1", "bogus"),
        ("train.steps=0", "train.steps"),
        ("sampling.temperature=-1", "sampling.temperature"),
        ("algo.name=ppo", "algo.name"),
    ],
)
def test_bad_keys_and_values_are_named(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["justaword"])


def test_lr_schedule_warms_up_then_stays_constant_or_decays_on_a_cosine():
    from p2prl.learner.core import LearnerCore, lr_factor
    from p2prl.policy import load_policy

    over = ["train.steps=100", "train.warmup_frac=0.1"]
    const = load_config(None, over).train
    cos = load_config(None, [*over, "train.lr_schedule=cosine", "train.lr_min_frac=0.2"]).train
    for t in (const, cos):
        assert [lr_factor(t, s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert const.lr_schedule == "constant" and all(lr_factor(const, s) == 1.0 for s in range(10, 150))
    after = [lr_factor(cos, s) for s in range(10, 100)]
    assert after[0] == pytest.approx(1.0, abs=1e-3) and all(a >= b for a, b in zip(after, after[1:]))
    assert lr_factor(cos, 54) == pytest.approx(0.6)  # halfway through the decay: midway between 1 and 0.2
    assert lr_factor(cos, 99) == pytest.approx(0.2) and lr_factor(cos, 500) == pytest.approx(0.2)
    # the learner's optimizer follows it, step by step
    cfg = load_config(None, [*over, "train.lr_schedule=cosine", "train.lr=0.01"])
    core = LearnerCore(load_policy("builtin"), cfg)
    lrs = []
    for _ in range(100):
        lrs.append(core.optimizer.param_groups[0]["lr"])
        core.optimizer.step()
        core.scheduler.step()
    assert lrs == pytest.approx([0.01 * lr_factor(cfg.train, s) for s in range(100)])


@pytest.mark.parametrize("name, digest", [
    ("default.toml", "5dba37422c494e434f0685bdeba429d27e1215dd04e54c9c7aea0335717fdd7d"),
    ("math.toml", "45d432f02cfa651805a55472fa2951ccb2f020bb76635c79a4460dc7b69c90e4"),
    ("latency.toml", "298f89a04f32ca7a1ef41a7a0c8b218ca4ba322fe5eb90ff2c6a0d74bab9f12d"),
])
def test_run_identity_of_shipped_configs_is_unchanged(name, digest):
    """Checkpoints and peers compare the run identity key by key (``algo`` as the run config's too): the objectives'
    settings declared by their classes leave it as it was, every objective's keys included."""
    import hashlib
    import json
    from pathlib import Path

    from p2prl.config import SAMPLER_RUNTIME

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    ident = cfg.run_identity()
    assert not set(SAMPLER_RUNTIME) & set(ident["sampling"])  # each sampler's own: a checkpoint compares none
    # as the identity was before those keys left it (a checkpoint compares the keys the identity has now, so one
    # saved with them still resumes): the rest is unchanged
    ident["sampling"] |= {"backend": "transformers", "vllm_dtype": "float32", "vllm_kv_cache_gib": 0.0}
    assert hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest() == digest


def test_a_typo_in_a_config_file_names_the_file_and_its_line(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text('# my run\n[model]\npath = "builtin"\n\n[train]\nstpes = 10\nlr = 1e-4\n')
    with pytest.raises(ConfigError) as e:
        load_config(run, ["train.lr=-1"])
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid config:"
    assert f"  {run}, line 6: train.stpes: unknown key (did you mean 'train.steps'?)" in lines
    assert any(line.startswith("  override train.lr: ") for line in lines), lines  # the command line's, not the file's
    run.write_text('train.stpes = 10\n')
    with pytest.raises(ConfigError, match=rf"  {re.escape(str(run))}, line 1: train\.stpes: unknown key"):
        load_config(run)


def test_lr_steps_keeps_a_schedule_when_train_steps_is_raised(capsys):
    from p2prl.cli import main
    from p2prl.learner.core import lr_factor

    tuned = load_config(None, ["train.steps=100", "train.lr_schedule=cosine"]).train
    longer = load_config(None, ["train.steps=1000", "train.lr_schedule=cosine"]).train  # stretched: higher for longer
    kept = load_config(None, ["train.steps=1000", "train.lr_schedule=cosine", "train.lr_steps=100"]).train
    assert lr_factor(longer, 99) > 0.9 > lr_factor(tuned, 50) > lr_factor(tuned, 99) == pytest.approx(0.1)
    assert [lr_factor(kept, s) for s in range(100)] == [lr_factor(tuned, s) for s in range(100)]
    assert all(lr_factor(kept, s) == pytest.approx(0.1) for s in (99, 100, 500, 999))  # then lr_min_frac x lr
    assert main(["config", "show"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "raising steps in a copied config (or to go on with a run) stretches them" in flat
    assert "Set, raising train.steps leaves the schedule as it is" in flat
