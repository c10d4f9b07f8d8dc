"""Write a benchmark's output into its own section of docs/results.md."""

from __future__ import annotations

import platform
import re
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results.md"


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_section(name: str, title: str, command: str, body: str) -> None:
    """Replace (or append) the section ``name`` of docs/results.md."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    block = (
        f"<!-- bench:{name} -->\n## {title}\n\n"
        f"Command: `{command}`  \nRun: {stamp} on {machine()}\n\n{body.strip()}\n<!-- /bench:{name} -->"
    )
    text = RESULTS.read_text() if RESULTS.exists() else "# Results\n\nEvery section below is written by the benchmark it names; none is typed by hand.\n"
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
