"""In-process stand-ins for a libp2p stream's reader and writer (unit tests of stream handlers), for the node that
serves request/reply protocols on them, and for the futures of a node's calls."""

import asyncio
from concurrent.futures import Future

import msgpack

from p2prl.net.messages import MessageError
from p2prl.net.node import SwarmNode


def frame(payload: bytes) -> asyncio.StreamReader:
    """A reader holding one frame (8-byte big-endian length, then the payload)."""
    reader = asyncio.StreamReader()
    reader.feed_data(len(payload).to_bytes(8, "big") + payload)
    reader.feed_eof()
    return reader


class Writer:
    """Collects what a handler writes; ``reply()`` decodes the one msgpack frame written."""

    def __init__(self):
        self.data = b""

    def write(self, b):
        self.data += bytes(b)

    async def drain(self):
        pass

    def reply(self) -> dict:
        return msgpack.unpackb(self.data[8:])


class Served:
    """A stand-in node whose ``serve_rpc`` is ``SwarmNode``'s (its framing, bounds, decoding and handling of bad
    requests), serving on in-memory streams: ``handlers[name](peer, reader, writer)``."""

    limits = None
    serve_rpc = SwarmNode.serve_rpc

    def __init__(self):
        self.handlers = {}

    def serve(self, name, handler, timeout_s=None, learners_only=False):
        self.handlers[name] = handler

    def transfer_timeout(self, nbytes):
        return 10.0


def served(role) -> dict:
    """The stream handlers ``role.serve(node)`` registers, on in-memory streams."""
    node = Served()
    role.serve(node)
    return node.handlers


class WireFuture(Future):
    """A reply future a test completes with the reply's bytes, decoded as ``SwarmNode.call_async`` decodes them: a
    reply that does not parse is the future's exception."""

    def __init__(self, reply_type):
        super().__init__()
        self.reply_type = reply_type

    def set_result(self, raw):
        try:
            reply = self.reply_type.decode(raw)
        except MessageError as e:
            return super().set_exception(e)
        return super().set_result(reply)
