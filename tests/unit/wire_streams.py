"""A frame stream over a socket pair that yields given bytes, then EOF (the wire tests)."""

from __future__ import annotations

import socket

from rootstock.wire.framing import FrameStream


def stream_of(data: bytes, timeout: float = 5.0) -> FrameStream:
    """A stream that yields ``data`` and then EOF, each read within ``timeout`` seconds."""
    reader, writer = socket.socketpair()
    writer.sendall(data)
    writer.close()
    stream = FrameStream(reader, peer="test", slice_s=0.05)
    stream.set_deadline(timeout)
    return stream
