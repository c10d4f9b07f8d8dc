"""Weight fetch logic: range requests validated by the holder; ranges assembled into one buffer, hashed as they
arrive, resumed from another holder when one fails. The holders here are the real ``weights_handler`` on
in-memory streams (tests/network/test_weight_ranges.py runs real peers)."""

import asyncio
import hashlib
import os

import pytest

from p2prl.net.dht import PolicyRecord
from p2prl.net.fetch import MIN_SPLIT, Assembly, Piece, assemble, range_request, split
from p2prl.net.node import refusal
from p2prl.net.messages import pack
from p2prl.net.protocol import MISSING, OK, WeightStore, weights_handler

from helpers.streams import Writer, frame

SHA = "ab" * 32


def ask(store: WeightStore, req: dict, reported: list | None = None) -> bytes:
    w = Writer()
    handle = weights_handler(store, reject=lambda peer, reason: reported.append(reason) if reported is not None else None)

    async def go():
        await handle("12D3KooWabcXYZ123", frame(pack(req)), w)

    asyncio.run(go())
    return w.data


def test_a_weights_range_is_served_and_counted_as_its_bytes():
    store = WeightStore(keep=2, max_uploads_per_version=1)
    store.add(3, SHA, b"0123456789")
    assert ask(store, {"version": 3, "sha256": SHA, "offset": 2, "length": 5}) == (6).to_bytes(8, "big") + OK + b"23456"
    assert ask(store, {"version": 3, "sha256": SHA, "offset": 9, "length": 1}) == (2).to_bytes(8, "big") + OK + b"9"
    assert ask(store, {"version": 3, "sha256": SHA}) == (11).to_bytes(8, "big") + OK + b"0123456789"
    assert ask(store, {"version": 4, "sha256": SHA, "offset": 0, "length": 1}) == (1).to_bytes(8, "big") + MISSING
    assert store.bytes_served == 5 + 1 + 10 and store.uploads == 3 and store.bad_requests == 0


@pytest.mark.parametrize("rng", [
    {"offset": -1, "length": 4},  # negative offset
    {"offset": 0, "length": 0},  # empty
    {"offset": 2, "length": -3},  # negative length
    {"offset": 4, "length": 7},  # past the end (oversize)
    {"offset": 0, "length": 11},  # longer than the blob
    {"offset": 10, "length": 1},  # starts at the end
    {"offset": 2**64 - 1, "length": 2**64 - 1},  # huge
    {"offset": 2},  # half a range
    {"length": 2},
    {"offset": "0", "length": 2},  # not ints
    {"offset": 0, "length": True},
    {"offset": 0.0, "length": 2},
])
def test_a_bad_weights_range_gets_no_reply_and_counts(rng):
    store = WeightStore(keep=2, max_uploads_per_version=1)
    store.add(3, SHA, b"0123456789")
    reported = []
    assert ask(store, {"version": 3, "sha256": SHA, **rng}, reported) == b""
    assert store.bad_requests == 1 and reported == ["bad_weights_request"]
    assert store.uploads == 0 and store._active.get(3, 0) == 0  # no upload slot taken


def test_split_covers_the_blob_and_keeps_small_blobs_whole():
    assert [(p.start, p.end) for p in split(1000, 2)] == [(0, 1000)]
    pieces = split(MIN_SPLIT + 1, 2)
    assert [(p.start, p.end) for p in pieces] == [(0, (MIN_SPLIT + 1) // 2), ((MIN_SPLIT + 1) // 2, MIN_SPLIT + 1)]
    assert len(split(MIN_SPLIT, 1)) == 1 and len(split(64 * MIN_SPLIT, 3)) == 3
    rec = PolicyRecord(version=1, sha256=SHA, size=100)
    assert b"offset" not in range_request(rec, Piece(0, 100)).encode()  # the whole blob: a protocol 4 request
    p = Piece(50, 100)
    p.pos = 60
    assert range_request(rec, p).encode() == pack({"version": 1, "sha256": SHA, "offset": 60, "length": 40})


def test_the_hash_follows_the_contiguous_prefix_that_arrived():
    a, b = Piece(0, 10), Piece(10, 20)

    async def go():
        asm = Assembly(20, [a, b])
        assert asm.arrived() == 0
        b.pos = 20  # the second half first: nothing contiguous from the start yet
        assert asm.arrived() == 0
        a.pos = 4
        assert asm.arrived() == 4
        a.pos = 10
        assert asm.arrived() == 20

    asyncio.run(go())


# ---- assemble() against in-memory holders running the real handler ----
class Pipe:
    """A writer that feeds a reader; ``cut_after``: bytes after which the stream breaks (a holder dying)."""

    def __init__(self, reader: asyncio.StreamReader, cut_after: int | None = None):
        self.reader, self.left = reader, cut_after

    def write(self, b):
        b = bytes(b)
        if self.left is not None:
            if self.left <= 0:
                raise ConnectionResetError("holder gone")
            b, self.left = b[: self.left], self.left - len(b)
        self.reader.feed_data(b)

    async def drain(self):
        await asyncio.sleep(0)  # let the fetcher read: the two holders' streams interleave
        if self.left is not None and self.left <= 0:
            raise ConnectionResetError("holder gone")

    def close(self):
        if not self.reader.at_eof():
            self.reader.feed_eof()


class Holders:
    """Holders by name, each a ``WeightStore`` behind ``weights_handler`` (or refusing, or breaking mid-way);
    the fake node's ``open_stream`` connects to them."""

    def __init__(self, blobs: dict[str, bytes], sha: str, refuse=(), cut: dict[str, int] | None = None):
        self.handlers, self.refuse, self.cut, self.opened = {}, set(refuse), cut or {}, []
        self.stores = {}
        for name, blob in blobs.items():
            self.stores[name] = WeightStore(keep=1, max_uploads_per_version=4)
            self.stores[name].add(1, sha, blob)
            self.handlers[name] = weights_handler(self.stores[name])

    async def open_stream(self, holder: str, name: str):
        assert name == "weights"
        self.opened.append(holder)
        to_holder, to_fetcher = asyncio.StreamReader(), asyncio.StreamReader()
        out = Pipe(to_fetcher, self.cut.get(holder))

        async def serve():
            try:
                if holder in self.refuse:
                    out.write(len(refusal("limited")).to_bytes(8, "big") + refusal("limited"))
                else:
                    await self.handlers[holder](holder, to_holder, out)
            except ConnectionError:
                pass
            finally:
                out.close()

        asyncio.ensure_future(serve())
        return to_fetcher, Pipe(to_holder)

    def transfer_timeout(self, nbytes: int) -> float:
        return 10.0


def fetch(holders: Holders, names: list[str], rec: PolicyRecord, parallel: int = 2):
    async def go():
        return await asyncio.wait_for(assemble(holders, names, rec, parallel), 30)

    return asyncio.run(go())


BLOB = os.urandom(MIN_SPLIT + 12345)
REC = PolicyRecord(version=1, sha256=hashlib.sha256(BLOB).hexdigest(), size=len(BLOB))


def test_two_holders_serve_one_half_each():
    holders = Holders({"A": BLOB, "B": BLOB}, REC.sha256)
    got = fetch(holders, ["A", "B"], REC)
    assert bytes(got.blob) == BLOB and sorted(got.holders) == ["A", "B"] and got.bad_hashes == 0
    assert holders.stores["A"].bytes_served == len(BLOB) // 2 and holders.stores["B"].bytes_served == len(BLOB) - len(BLOB) // 2


def test_a_holder_dying_mid_range_is_resumed_by_the_other():
    holders = Holders({"A": BLOB, "B": BLOB}, REC.sha256, cut={"B": 3 << 20})
    got = fetch(holders, ["A", "B"], REC)
    assert bytes(got.blob) == BLOB and got.bad_hashes == 0
    assert sorted(got.holders) == ["A", "B"]  # B's first bytes are kept (and checked by the hash)
    assert holders.opened == ["A", "B", "A"]
    # A served its half, then the rest of B's from where B stopped (less what the stream had buffered)
    assert len(BLOB) - (3 << 20) - 8 - 1 <= holders.stores["A"].bytes_served < len(BLOB)


def test_a_refusing_holder_leaves_the_whole_blob_to_the_other():
    holders = Holders({"A": BLOB, "B": BLOB}, REC.sha256, refuse={"B"})
    got = fetch(holders, ["B", "A"], REC)
    assert bytes(got.blob) == BLOB and got.holders == ["A"] and got.limited == ["B"]  # the sampler slows down to B
    assert holders.stores["A"].bytes_served == len(BLOB) and holders.opened == ["B", "A", "A"]


def test_bad_bytes_from_one_holder_fail_the_hash():
    bad = bytearray(BLOB)
    bad[-1] ^= 1
    holders = Holders({"A": BLOB, "B": bytes(bad)}, REC.sha256)
    got = fetch(holders, ["A", "B"], REC)
    assert got.blob is None and got.bad_hashes == 1 and sorted(got.holders) == ["A", "B"]
    assert fetch(holders, ["A"], REC, parallel=1).blob == BLOB  # A alone is fine


def test_no_holder_left_gives_nothing():
    holders = Holders({"A": BLOB, "B": BLOB}, REC.sha256, refuse={"A", "B"})
    got = fetch(holders, ["A", "B"], REC)
    assert got.blob is None and got.bad_hashes == 0 and got.holders == [] and sorted(got.limited) == ["A", "B"]


def test_the_store_keeps_recent_versions_for_far_peers_within_its_memory():
    now = [0.0]
    store = WeightStore(keep=2, max_uploads_per_version=1, keep_s=30.0, keep_bytes=4000, clock=lambda: now[0])
    for v in range(5):  # five versions in 4 s: all younger than 30 s, 5 x 500 bytes fit 4000
        store.add(v, f"h{v}", bytes(500))
        now[0] += 1.0
    assert [v for v in range(5) if store.sha(v)] == [0, 1, 2, 3, 4]
    now[0] = 32.5  # versions 0..2 are now older than 30 s: only the newest 2 and the recent ones stay
    store.add(5, "h5", bytes(500))
    assert [v for v in range(6) if store.sha(v)] == [3, 4, 5]
    for v in range(6, 12):  # memory: at most 4000 bytes, never fewer than keep versions
        store.add(v, f"h{v}", bytes(1500))
    assert [v for v in range(12) if store.sha(v)] == [10, 11]
    plain = WeightStore(keep=2, max_uploads_per_version=1)  # no keep_s: the newest keep only
    for v in range(4):
        plain.add(v, f"h{v}", b"x")
    assert [v for v in range(4) if plain.sha(v)] == [2, 3]
