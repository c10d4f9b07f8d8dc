"""Benchmark: how many copies of each policy version the learner uploads when 4 samplers fetch it.

    python benchmarks/weight_fanout.py [--samplers 4] [--steps 60] [section.key=value ...]

Runs a real local swarm with the CLI (``p2prl swarm up``: bootstrap + learner + N samplers as separate
processes on 127.0.0.1, loopback-only settings) for ``--steps`` versions of the default config, then reads

* the learner's ``metrics.jsonl`` (in ``<out_dir>/learner/``): ``net/weights_bytes_served`` and ``net/weights_uploads`` on its last line;
* the size of the published blob: ``serialize_weights`` of the learner's final checkpoint (every version
  has the same tensors, so the same size);
* each sampler's final summary (printed on SIGTERM into ``logs/sampler<i>.log``): from a JSON one
  ``weights/fetched_from_learner`` and ``weights/fetched_from_sampler``; the versions it loaded from either kind.

Copies per version = bytes served by the learner / (versions published before its last metrics line x blob
size). Target: at most 2 copies per version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def last_json(text: str) -> dict | None:
    """The last top-level JSON object a peer printed (its summary)."""
    start = text.rfind("\n{")
    if start < 0:
        return None
    try:
        return json.loads(text[start + 1 : text.index("\n}", start) + 2])
    except ValueError:
        return None


def versions_loaded(summary: dict | None, text: str) -> set[int]:
    """The versions a sampler loaded (its most recent 256): ``versions_loaded`` of its JSON summary, else the
    ``policy version(s) loaded, the last vN: v0-3, v5`` line of the summary it prints for a person."""
    if summary is not None and "versions_loaded" in summary:
        return {int(v) for v in summary["versions_loaded"]}
    found = re.findall(r"policy version\(s\) loaded, the last v\d+: (?:\.\.\., )?(.*)", text)
    out = set()
    for part in (found[-1].split(", ") if found else []):
        a, _, b = part.strip().lstrip("v").partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def learner_dir(out: Path) -> Path:
    """Where `swarm up`'s learner writes (``<out_dir>/learner`` in newer versions, ``<out_dir>`` before)."""
    return out / "learner" if (out / "learner").is_dir() else out


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def run_swarm(args: list[str], timeout_s: float, log_path: Path, until=lambda: False) -> tuple[int, float]:
    """Run ``p2prl swarm up`` in its own session until it exits, ``until()`` is true or ``timeout_s`` passed;
    then stop it (SIGINT: it stops its peers) and kill whatever is left of it and every peer it started."""
    with log_path.open("wb") as log:
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "p2prl.cli", "swarm", "up", *args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        peers: set[int] = set()
        try:
            while proc.poll() is None and time.time() - t0 < timeout_s and not until():
                peers.update(children_of(proc.pid))  # each peer runs in its own session
                time.sleep(0.5)
            return (proc.returncode if proc.poll() is not None else -1), t0
        finally:
            if proc.poll() is None:  # SIGINT: `swarm up` stops its peers by process group
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            for pid in [proc.pid, *peers]:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samplers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()

    from p2prl.policy import load_policy
    from p2prl.policy.weights import serialize_weights

    with tempfile.TemporaryDirectory(prefix="p2prl-fanout-") as tmp:
        out = Path(tmp) / "run"
        args = ["--config", "configs/default.toml", "--fresh", "--no-progress", "--samplers", str(a.samplers),
                f"train.out_dir={out}", f"train.steps={a.steps}", "net.run_id=bench-fanout", *a.overrides]
        code, t0 = run_swarm(args, 280, Path(tmp) / "swarm.log")
        wall = time.time() - t0
        if code != 0:
            raise SystemExit(f"swarm up exited with {code}:\n{(Path(tmp) / 'swarm.log').read_text()[-4000:]}")
        lines = [json.loads(l) for l in (learner_dir(out) / "metrics.jsonl").read_text().splitlines() if l.strip()]
        last = lines[-1]
        size = len(serialize_weights(load_policy(learner_dir(out) / "checkpoint").model)[0])
        summaries, loaded = {}, set()
        for i in range(a.samplers):
            text = (out / "logs" / f"sampler{i}.log").read_text(errors="replace")
            summaries[f"sampler{i}"] = s = last_json(text)
            loaded.update(versions_loaded(s, text))
        from p2prl.config import load_config

        max_uploads = load_config(ROOT / "configs/default.toml", a.overrides).flow.max_uploads_per_version

    versions = last["step"]  # v0 .. v(step-1) were fetchable before the last line; v(step) had just been published
    served, uploads = last["net/weights_bytes_served"], last["net/weights_uploads"]
    copies = served / (versions * size)
    ok = copies <= 2.0
    rows = []
    tot_l = tot_s = 0
    for name, s in summaries.items():
        if s is None:
            rows.append(f"| {name} | (no summary printed) | | |")
            continue
        fl, fs = s.get("weights/fetched_from_learner", 0), s.get("weights/fetched_from_sampler", 0)
        tot_l, tot_s = tot_l + fl, tot_s + fs
        rows.append(f"| {name} | {fl} | {fs} | {s.get('groups_made', 0)} |")
    rows.append(f"| all samplers | {tot_l} | {tot_s} | |")
    body = "\n".join([
        "| versions | blob (bytes) | learner uploads | learner bytes served | copies per version | target: <= 2 copies "
        "| versions loaded by any sampler | learner copies per loaded version | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {versions} | {size} | {uploads} | {served} | {copies:.2f} | {'met' if ok else 'MISSED'} | {len(loaded)} | "
        f"{served / (max(1, len(loaded)) * size):.2f} | {wall:.0f} |",
        "",
        "| sampler | fetched from learner | fetched from a sampler | groups made |",
        "|---|---|---|---|",
        *rows,
    ]) + (
        f"\n\nA real local swarm (`p2prl swarm up`, default config, {a.samplers} samplers, {a.steps} versions, "
        f"learner `flow.max_uploads_per_version` = {max_uploads}) on 127.0.0.1. Copies per version = learner bytes "
        f"served / ({versions} versions x blob size); {tot_l + tot_s} version loads in all by the samplers, "
        f"{100 * tot_l / max(1, tot_l + tot_s):.0f}% of them from the learner. Samplers take up the newest version "
        "when they poll (every `net.poll_s`), so they skip versions the learner publishes faster than that; "
        "the copies per version therefore measure the learner's upload per version it published; the stricter "
        "\"per loaded version\" column divides by the versions some sampler actually loaded (their summaries). "
        "The blob is the shipped tiny policy's (the default config); uploads of a larger model last longer, "
        "which changes how fetches overlap, so this count is for this size only."
    )
    print(body)
    shown = " ".join(["python benchmarks/weight_fanout.py"]
                     + (["--samplers", str(a.samplers)] if a.samplers != 4 else [])
                     + (["--steps", str(a.steps)] if a.steps != 60 else []) + a.overrides)
    write_section("weight_fanout", f"Weight fan-out: learner upload per version with {a.samplers} samplers", shown, body)


if __name__ == "__main__":
    main()
