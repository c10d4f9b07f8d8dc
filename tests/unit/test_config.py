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
