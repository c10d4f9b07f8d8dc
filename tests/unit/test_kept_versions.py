"""The versions a learner keeps for spot checks (p2prl/learner/kept.py): memory first, then disk, then dropped."""

import torch

from p2prl.learner.kept import KeptVersions, load_kept
from p2prl.policy import load_policy
from p2prl.policy.weights import serialize_weights

BLOB = b"w" * 1000


def test_memory_only_keeps_the_newest_that_fit_and_the_newest_always():
    kept = KeptVersions(count=4, memory_bytes=2500, disk_bytes=0, folder=None)
    for v in range(1, 6):
        kept.keep(v, f"sha{v}", BLOB)
    assert kept.placement() == {4: "memory", 5: "memory"}
    assert kept.get(3) is None and kept.get(5) == ("sha5", BLOB)
    kept.memory_bytes = 1  # not even one fits: the newest stays anyway
    kept.keep(6, "sha6", BLOB)
    assert kept.placement() == {6: "memory"}


def test_older_versions_go_to_disk_within_its_budget_and_leave_with_the_window(tmp_path):
    folder = tmp_path / "kept"
    folder.mkdir()
    (folder / "v7-stale.safetensors").write_bytes(b"from a killed run")
    kept = KeptVersions(count=4, memory_bytes=1500, disk_bytes=2100, folder=folder)
    assert not folder.exists()  # a killed run's files are gone
    for v in range(1, 5):
        kept.keep(v, f"sha{v}", BLOB + bytes([v]))
    kept.flush()
    assert kept.placement() == {2: "disk", 3: "disk", 4: "memory"}  # two fit on disk: v1 made room for v3
    sha, path = kept.get(3)
    assert sha == "sha3" and path.read_bytes() == BLOB + bytes([3])
    kept.make_room(6)  # the window of v6 is 3..6
    assert kept.placement() == {3: "disk", 4: "memory"}
    assert sorted(p.name for p in folder.iterdir()) == [path.name]
    kept.close()
    assert not folder.exists()


def test_a_write_that_fails_drops_the_version(tmp_path):
    folder = tmp_path / "kept"
    folder.write_text("a file where the folder should be")
    kept = KeptVersions(count=4, memory_bytes=1500, disk_bytes=10_000, folder=tmp_path / "kept" / "sub")
    kept.keep(1, "sha1", BLOB)
    kept.keep(2, "sha2", BLOB)
    kept.flush()
    assert kept.placement() == {2: "memory"}
    kept.close()


def test_a_file_loads_the_same_weights_as_the_bytes(tmp_path):
    trained, fresh = load_policy("builtin").model, load_policy("builtin").model
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    blob, _ = serialize_weights(trained)
    path = tmp_path / "v1.safetensors"
    path.write_bytes(blob)
    load_kept(fresh, path)
    want = trained.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in fresh.state_dict().items())
