"""The policy objectives, registered by name: each says what the learner, the spot check and the config ask of it.

    from p2prl.algo.objectives import OBJECTIVES
    objective = OBJECTIVES[cfg.algo.name](cfg.algo)
    loss, metrics = objective.loss(logp, logq, mask, advantages, group_size)

An objective is a subclass of ``Objective`` with a ``name``, registered with ``@register``. It holds the ``algo``
config section (``settings``, read by attribute) and says:

* ``loss``: its loss on rows (one of the pure functions of ``p2prl.algo.losses``, with its keyword arguments from
  the section; ``beta_kl`` goes to every objective);
* ``fields``: its own keys of the ``algo`` section (``Setting``: type, default, description, bounds); the
  section is the shared keys (``name``, ``eps``, ``beta_kl``, ``scale_std``) plus those of every objective
  registered when ``p2prl.config`` is imported;
* ``chunk_rows``: whether the loss is taken per group (0) or per shuffled chunk of this many rows of the step
  (GEPO with scope "batch");
* ``token_weighted``: whether its weight metrics are averaged over masked tokens when pieces are merged (GRPO's
  weights are per token);
* ``clip_eps``: the upper clip of its importance weight (the spot check warns when its tolerance lets a forgery
  reach it);
* ``shown``: the metrics the learner's progress line shows, ``(label, loss metric key)`` or ``(label, key,
  format spec)`` (default ``.2e``); the base shows ``kl``, the mean per-token log-ratio log q - log p (``kl_k1``,
  nats per token: readable where the k3 estimate the penalty uses, kept in the metrics, reaches 1e7), and ``wvar``;
* ``scale_std``: its default for ``algo.scale_std`` (dividing advantages by the group std).

A new objective is one class here (or in a module imported here) and its tests. No torch is imported here until a
loss is computed (the CLI reads the names before it imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

OBJECTIVES: dict[str, type[Objective]] = {}
"""Every registered objective by name, in registration order (``algo.name``'s choices)."""


@dataclass(frozen=True)
class Setting:
    """One key of the ``algo`` config section that an objective declares."""

    type: Any  # float, int, a Literal of the allowed strings...
    default: Any
    description: str
    bounds: dict[str, Any] = field(default_factory=dict)  # pydantic Field's: ge, gt, le, lt


def register(cls: type[Objective]) -> type[Objective]:
    """Class decorator: add ``cls`` to ``OBJECTIVES`` under ``cls.name``."""
    if cls.name in OBJECTIVES:
        raise ValueError(f"objective {cls.name!r} is registered twice")
    OBJECTIVES[cls.name] = cls
    return cls


class Objective:
    """A policy objective on the ``algo`` config section ``settings``; subclasses set ``name`` and override
    ``function`` and ``loss_kwargs`` (or ``loss`` itself)."""

    name: ClassVar[str]
    fields: ClassVar[dict[str, Setting]] = {}
    """Its own ``algo`` keys."""
    token_weighted: ClassVar[bool] = False
    shown: ClassVar[tuple[tuple[str, ...], ...]] = (("kl", "kl_k1", ".3f"), ("wvar", "is_weight_var"))
    scale_std: ClassVar[bool] = True

    def __init__(self, settings: Any):
        self.settings = settings

    @staticmethod
    def function() -> Callable[..., tuple[Tensor, dict]]:
        """The pure loss function of ``p2prl.algo.losses`` (imported when first asked for)."""
        raise NotImplementedError

    def loss_kwargs(self, group_size: int) -> dict:
        """The keyword arguments of ``function`` from the section, besides ``beta_kl``."""
        raise NotImplementedError

    def loss(self, logp: Tensor, logq: Tensor, mask: Tensor, advantages: Tensor,
             group_size: int) -> tuple[Tensor, dict[str, float]]:
        """``(loss, metrics)`` on rows whose learner log-probs are ``logp`` (B, T); ``group_size``: the rows' G (GEPO
        scope "batch": the rows its denominator spans)."""
        return self.function()(logp, logq, mask, advantages, **self.loss_kwargs(group_size),
                               beta_kl=self.settings.beta_kl)

    def chunk_rows(self) -> int:
        """0: the loss is taken per group; n: per chunk of n rows of the step, shuffled."""
        return 0

    def clip_eps(self) -> float:
        """The upper clip of its importance weight."""
        return self.settings.eps

    def progress(self, metrics: dict[str, float]) -> str:
        """Its part of the learner's progress line, from a step's metrics (``loss/<key>``)."""
        def said(x: float, spec: str) -> str:
            text = f"{x:{spec}}"
            return text[1:] if text.startswith("-") and float(text) == 0 else text  # not "-0.000"

        return " ".join(f"{label} {said(metrics[f'loss/{key}'], fmt[0] if fmt else '.2e')}"
                        for label, key, *fmt in self.shown)


@register
class GEPO(Objective):
    """Group Expectation Policy Optimization (arXiv 2508.17850): ``gepo_loss``."""

    name = "gepo"
    scale_std = False  # as in the paper
    fields = {
        "scope": Setting(Literal["group", "batch"], "group",
                         "GEPO denominator over one prompt's G completions (paper) or over each shuffled chunk of "
                         "batch_rows rows of the step (authors' code)."),
        "gepo_variant": Setting(Literal["standard", "plus"], "standard",
                                "GEPO as in the paper, or 'plus' (authors' code): a sequence whose per-token mean k3 "
                                "is below plus_k3 uses its own q instead of the group expectation."),
        "plus_k3": Setting(float, 0.002, "k3 threshold of gepo_variant 'plus' (authors' code: 0.002).",
                           {"ge": 0.0, "le": 10.0}),
        "batch_rows": Setting(int, 8, "scope=batch: a step's rows are shuffled and GEPO's denominator is taken over "
                                      "each chunk of this many rows (the authors' code: 8).", {"ge": 1, "le": 65_536}),
    }

    @staticmethod
    def function():
        from p2prl.algo.losses import gepo_loss

        return gepo_loss

    def loss_kwargs(self, group_size: int) -> dict:
        from p2prl.algo.losses import GepoOptions

        a = self.settings
        return {"options": GepoOptions(group_size, eps=a.eps, scope=a.scope, variant=a.gepo_variant,
                                       plus_k3=a.plus_k3)}

    def chunk_rows(self) -> int:
        return self.settings.batch_rows if self.settings.scope == "batch" else 0


@register
class GSPO(Objective):
    """Group Sequence Policy Optimization: ``gspo_loss``."""

    name = "gspo"
    fields = {
        "gspo_eps_low": Setting(float, 3e-4, "GSPO lower clip (GSPO paper: 3e-4).", {"gt": 0.0, "le": 10.0}),
        "gspo_eps_high": Setting(float, 4e-4, "GSPO upper clip (GSPO paper: 4e-4).", {"gt": 0.0, "le": 10.0}),
    }

    @staticmethod
    def function():
        from p2prl.algo.losses import gspo_loss

        return gspo_loss

    def loss_kwargs(self, group_size: int) -> dict:
        return {"eps_low": self.settings.gspo_eps_low, "eps_high": self.settings.gspo_eps_high}

    def clip_eps(self) -> float:
        return self.settings.gspo_eps_high


@register
class GRPO(Objective):
    """Group Relative Policy Optimization: ``grpo_loss`` (token ratios, so its weight metrics are per token)."""

    name = "grpo"
    token_weighted = True

    @staticmethod
    def function():
        from p2prl.algo.losses import grpo_loss

        return grpo_loss

    def loss_kwargs(self, group_size: int) -> dict:
        return {"eps": self.settings.eps}
