"""In-process stand-ins for a libp2p stream's reader and writer (unit tests of stream handlers)."""

import asyncio

import msgpack


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
