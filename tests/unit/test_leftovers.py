"""The session-end clean-up of tests/conftest.py finds and kills what tests leave running, orphans included."""

import os
import secrets
import subprocess
import time

from helpers.leftovers import SESSION_MARK, kill, left_behind, proc_stat


def _gone(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat[0] == "Z"


def test_an_orphaned_process_group_is_found_and_killed():
    token = secrets.token_hex(8)
    mark = f"{SESSION_MARK}={token}".encode()
    # `sh` exits at once; its `sleep` lives on in the new session, reparented away from us
    env = {**os.environ, SESSION_MARK: token}
    out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], env=env, capture_output=True,
                         text=True, timeout=10, start_new_session=True)
    orphan = int(out.stdout.split()[0])
    try:
        assert proc_stat(orphan)[1] != os.getpid()  # not our child: only the mark finds it
        found = left_behind(mark)  # the mark alone: nothing else this session runs is touched
        assert list(found) == [orphan] and "sleep 60" in found[orphan][1]
        killed = kill(found)
        assert any(k.startswith(f"pid {orphan} ") for k in killed), killed
        deadline = time.monotonic() + 10
        while not _gone(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(orphan)
        assert left_behind(mark) == {}
    finally:
        if not _gone(orphan):
            os.kill(orphan, 9)
