"""Fetching one policy version's weights from its holders: byte ranges into one buffer, hashed as they arrive.

The version's bytes go into one preallocated buffer of the record's (bounded) size; nothing is
joined or copied afterwards. A blob of at least ``MIN_SPLIT`` bytes is split into one range per
holder, up to ``parallel`` holders at once (``flow.fetch_parallel``); a range whose holder fails,
refuses or is busy is resumed, from the byte reached, by the next holder (one that delivered
its range, or one not tried yet). One sha256 follows the contiguous prefix that has arrived,
in a worker thread while the streams go on, so that the hash is done soon after the last byte;
the whole must equal the record's hash, else the bytes are rejected.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field

from p2prl.net.dht import PolicyRecord
from p2prl.net.messages import WeightsRequest
from p2prl.net.node import FrameError, Refused, refused_reason, write_frame
from p2prl.net.protocol import OK
from p2prl.net.transport import WeightSource

log = logging.getLogger(__name__)

MIN_SPLIT = 8 << 20  # bytes: a smaller blob comes from one holder (a second stream costs more than it saves)
READ = 1 << 20  # bytes taken from the stream at a time
HASH_BATCH = 4 << 20  # bytes of arrived prefix the hash thread takes at a time
STATUS_NAMES = {b"\x01": "busy", b"\x02": "missing"}


@dataclass
class Piece:
    """The range [start, end) of the blob; ``pos``: where its bytes have arrived up to."""

    start: int
    end: int
    pos: int = field(init=False)

    def __post_init__(self):
        self.pos = self.start


@dataclass
class Fetched:
    """The outcome of a fetch: the verified bytes (None if none), and which holders delivered ranges."""

    blob: bytearray | None
    holders: list[str]
    bad_hashes: int = 0  # assembled blobs whose sha256 differed from the record's
    limited: list[str] = field(default_factory=list)  # holders that refused a range: over their limit for us


def split(size: int, n: int) -> list[Piece]:
    """``n`` contiguous ranges covering ``size`` bytes (one when the blob is under ``MIN_SPLIT``)."""
    n = max(1, min(n, size // (MIN_SPLIT // 2))) if size >= MIN_SPLIT else 1
    cuts = [size * i // n for i in range(n + 1)]
    return [Piece(a, b) for a, b in zip(cuts, cuts[1:])]


class Assembly:
    """One blob arriving in pieces into one buffer; a sha256 follows the contiguous prefix that has arrived."""

    def __init__(self, size: int, pieces: list[Piece]):
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.pieces = pieces
        self.hashed = 0
        self._sha = hashlib.sha256()
        self.progress = asyncio.Event()

    def arrived(self) -> int:
        """Bytes from the start that have all arrived."""
        end = 0
        for p in self.pieces:
            end = p.pos
            if p.pos < p.end:
                break
        return end

    async def hash_along(self, final: asyncio.Event) -> str:
        """Hash the arrived prefix as it grows (in a worker thread: hashlib releases the GIL); once ``final``
        is set, the rest that arrived. Returns the hex digest of what was hashed."""
        loop = asyncio.get_running_loop()
        while True:
            self.progress.clear()
            upto = self.arrived()
            if upto - self.hashed >= HASH_BATCH or (final.is_set() and upto > self.hashed):
                await loop.run_in_executor(None, self._sha.update, self.view[self.hashed : upto])
                self.hashed = upto
                continue
            if final.is_set():
                return self._sha.hexdigest()
            await self.progress.wait()


def range_request(rec: PolicyRecord, piece: Piece) -> WeightsRequest:
    """The ``weights`` request for what ``piece`` still lacks (the whole blob: no range, as protocol 4 asked)."""
    if (piece.pos, piece.end) == (0, rec.size):
        return WeightsRequest(rec.version, rec.sha256)
    return WeightsRequest(rec.version, rec.sha256, piece.pos, piece.end - piece.pos)


async def fetch_piece(node: WeightSource, holder: str, rec: PolicyRecord, asm: Assembly, piece: Piece) -> None:
    """Stream what ``piece`` lacks from ``holder`` into the buffer; ``piece.pos`` follows every byte.
    Raises ``Refused`` (refused, busy or missing), ``FrameError`` (a reply of the wrong length) or a
    connection error; the bytes that did arrive stay."""
    reader, writer = await node.open_stream(holder, "weights")
    try:
        await write_frame(writer, range_request(rec, piece).encode())
        n = int.from_bytes(await reader.readexactly(8), "big")
        want = piece.end - piece.pos
        if n != 1 + want:
            if n > 64:
                raise FrameError(f"reply of {n} bytes for a range of {want}")
            short = await reader.readexactly(n)
            raise Refused(refused_reason(short) or STATUS_NAMES.get(short, "bad reply"))
        if await reader.readexactly(1) != OK:
            raise FrameError("bad status byte")
        while piece.pos < piece.end:
            chunk = await reader.read(min(READ, piece.end - piece.pos))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", piece.end - piece.pos)
            asm.view[piece.pos : piece.pos + len(chunk)] = chunk
            piece.pos += len(chunk)
            asm.progress.set()
    finally:
        writer.close()


async def assemble(node: WeightSource, holders: list[str], rec: PolicyRecord, parallel: int) -> Fetched:
    """``rec``'s bytes from ``holders`` (tried in this order), ranges from up to ``parallel`` of them at once."""
    asm = Assembly(rec.size, split(rec.size, min(parallel, len(holders))))
    final = asyncio.Event()
    hasher = asyncio.ensure_future(asm.hash_along(final))
    todo, ready, used, limited = list(asm.pieces), list(holders), [], []
    active: dict[asyncio.Task, tuple[str, Piece]] = {}
    try:
        while True:
            while todo and ready:
                holder, piece = ready.pop(0), todo.pop(0)
                task = asyncio.ensure_future(asyncio.wait_for(fetch_piece(node, holder, rec, asm, piece),
                                                              node.transfer_timeout(piece.end - piece.pos)))
                active[task] = (holder, piece)
            if not active:
                break
            done, _ = await asyncio.wait(active, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                holder, piece = active.pop(task)
                e = task.exception()
                if e is None or piece.pos == piece.end:
                    ready.insert(0, holder)  # it delivered: first in line for a range another holder left
                    used.append(holder)
                    continue
                # routine (a busy or gone holder; the range goes to another): the caller says when a fetch fails
                log.debug("weights v%d [%d, %d) from %s failed at byte %d: %s %s", rec.version, piece.start, piece.end,
                          holder[-6:], piece.pos, type(e).__name__, str(e)[:80])
                if piece.pos > piece.start:
                    used.append(holder)  # its bytes are in the buffer: the hash checks them too
                if isinstance(e, Refused) and e.reason == "limited":
                    limited.append(holder)
                todo.append(piece)
        used = list(dict.fromkeys(used))
        if todo:  # holders ran out before the bytes did
            return Fetched(None, used, limited=limited)
        final.set()
        asm.progress.set()
        ok = await hasher == rec.sha256
        return Fetched(asm.buf if ok else None, used, bad_hashes=int(not ok), limited=limited)
    finally:
        for task in [*active, hasher]:
            task.cancel()
        await asyncio.gather(*active, hasher, return_exceptions=True)


def fetch_weights(node: WeightSource, holders: list[str], rec: PolicyRecord, parallel: int) -> Fetched:
    """Blocking ``assemble`` on the node's loop (given up when the node stops). When bytes from several
    holders fail the hash, each holder is then tried alone, so that one bad holder cannot spoil a fetch
    the others could serve."""
    got = node.run(assemble(node, holders, rec, parallel), timeout=len(holders) * node.transfer_timeout(rec.size) + 5)
    bad = got.bad_hashes
    if got.blob is None and bad and len(got.holders) > 1:
        for holder in holders:
            got = node.run(assemble(node, [holder], rec, 1), timeout=node.transfer_timeout(rec.size) + 5)
            bad += got.bad_hashes
            if got.blob is not None:
                break
    got.bad_hashes = bad
    return got
