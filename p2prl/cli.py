"""The ``p2prl`` command. Arguments are parsed before torch or hivemind is imported."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_CONFIG = "configs/default.toml"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="TOML config file (see configs/); defaults apply to missing keys")
    p.add_argument(
        "overrides", nargs="*", metavar="section.key=value",
        help="dotted overrides applied after the file, e.g. train.steps=50 algo.scope=batch",
    )


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="p2prl",
        description="Peer-to-peer RL post-training of language models with GEPO (HeteroRL).",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tr = sub.add_parser(
        "train", help="train on one machine (sampler and learner halves in one process)",
        description="Run HeteroRL on one machine: a sampler half and a learner half exchanging "
        "versioned rollout records, with a staleness window and an optional simulated sync delay. "
        "Resumes from <train.out_dir>/checkpoint when one exists.",
    )
    tr.add_argument("--algo", choices=["gepo", "gspo", "grpo"], help="objective (overrides algo.name)")
    tr.add_argument("--fresh", action="store_true", help="ignore and replace an existing checkpoint in train.out_dir")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar (metrics still go to metrics.jsonl)")
    _add_config_args(tr)
    return ap


def _load_config(args: argparse.Namespace):
    from p2prl.config import load_config

    overrides = list(args.overrides)
    if getattr(args, "algo", None):
        overrides.append(f"algo.name={args.algo}")
    return load_config(args.config, overrides)


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    from p2prl.train import train

    summary = train(cfg, fresh=args.fresh, progress=not args.no_progress)
    print(json.dumps(summary, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from p2prl.checkpoint import CheckpointError
    from p2prl.config import ConfigError
    from p2prl.policy.model import PolicyLoadError

    try:
        return {"train": _cmd_train}[args.command](args)
    except (ConfigError, CheckpointError, PolicyLoadError) as e:
        print(f"p2prl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"p2prl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
