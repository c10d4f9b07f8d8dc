"""Logging that names the role and the short peer id on every line."""

from __future__ import annotations

import logging


def setup_logging(role: str, peer: str = "", level: int = logging.INFO) -> None:
    tag = f"{role} {peer}".strip()
    logging.basicConfig(
        level=level, force=True,
        format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
