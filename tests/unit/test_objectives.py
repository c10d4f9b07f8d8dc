"""Objectives are registered classes: a new one is one class (here, in this file alone) and trains with `p2prl train`.

The toy objective below is registered by this test only: the config accepts its name, `p2prl train --algo` offers it,
the learner takes its loss per group with its own metric (it reports no ``kl_k3``) and the progress line shows it.
"""

import json

import pytest
import torch

from p2prl.algo.objectives import OBJECTIVES, Objective, register
from p2prl.cli import main
from p2prl.config import ConfigError, describe, load_config
from p2prl.experiments import grid


class Reinforce(Objective):
    """REINFORCE on the length-normalised sequence log-prob, no importance weight: minus the mean of A_i * lp_i."""

    name = "toy-reinforce"
    shown = (("surrogate", "surrogate"),)

    def loss(self, logp, logq, mask, advantages, group_size):
        m = mask.to(logp.dtype)
        lp = (logp * m).sum(1) / m.sum(1)  # (B,)
        loss = -(advantages.to(logp.dtype) * lp).mean()
        return loss, {"loss": float(loss.detach()), "surrogate": float(-loss.detach())}


@pytest.fixture
def toy():
    register(Reinforce)
    yield Reinforce
    del OBJECTIVES[Reinforce.name]


def test_a_registered_objective_trains_through_p2prl_train(toy, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--algo", toy.name, "--no-progress", "sampling.group_size=4", "train.steps=2",
                 "train.groups_per_step=2", "train.eval_every=1", "task.heldout_size=8", f"train.out_dir={out}"])
    assert code == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss/surrogate" in m]
    assert len(steps) == 2 and all("loss/kl_k3" not in m for m in steps)
    assert all(torch.isfinite(torch.tensor(m["loss/surrogate"])) for m in steps)
    assert steps[-1]["policy/version"] == 2
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["identity"]["algo"]["name"] == toy.name
    capsys.readouterr()


def test_the_progress_line_shows_the_objectives_metrics(toy):
    from p2prl.learner.core import progress_line

    m = {"policy/version": 3, "rollout/reward": 0.5, "rollout/lag_mean": 1.0, "loss/surrogate": 0.25}
    assert progress_line(m, 0.75, toy(load_config(None, [f"algo.name={toy.name}"]).algo)) == (
        "v3 reward 0.50 acc 0.750 surrogate 2.50e-01 lag 1.0")
    gepo = load_config(None).algo.objective()
    with pytest.raises(KeyError, match="loss/kl_k1"):  # GEPO shows the KL, which it always reports
        progress_line(m, 0.75, gepo)


def test_choices_come_from_the_registry(toy, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--algo {" + ",".join(OBJECTIVES) + "}" in capsys.readouterr().out and toy.name in OBJECTIVES
    row = next(r for r in describe(load_config(None)) if r["key"] == "algo.name")
    assert row["bound"] == " | ".join(OBJECTIVES) and toy.name in row["bound"]
    assert load_config(None, [f"algo.name={toy.name}"]).algo.std_scaling is True  # the base's default
    assert grid.ALGOS == ("gepo", "gspo", "grpo")  # the shipped ones, as registered at import


def test_an_unregistered_objective_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"algo\.name: unknown objective 'toy-reinforce'; one of gepo \| gspo"):
        load_config(None, ["algo.name=toy-reinforce"])


def test_an_objective_registered_twice_is_an_error(toy):
    with pytest.raises(ValueError, match="registered twice"):
        register(Reinforce)
