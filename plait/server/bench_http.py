"""The load generator's HTTP/1.1 client: one streamed POST per connection over asyncio streams.

``plait bench serve`` sends hundreds of streaming requests at once and reads tens of thousands of
events per second; httpx spends several times the server's CPU per event (its connection pool
scans every connection per request, and every read goes through anyio, a timeout handle and h11),
so a burst measured with it is partly a measurement of the client. This client does only what
the benchmark needs: write one request, read the status line and headers, then hand out the body
as it arrives (chunked transfer encoding, Content-Length, or until the server closes).
``http://`` only; other schemes go through httpx (``plait.server.bench``).
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass

# The longest status line, header line or chunk-size line accepted.
MAX_LINE = 64 * 1024


class ProtocolError(Exception):
    """The server's response is not HTTP/1.1 this client can read."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased
    reader: asyncio.StreamReader

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives, transfer encoding removed."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await self.reader.readline()
                if not size_line.endswith(b"\n") or len(size_line) > MAX_LINE:
                    raise ProtocolError(f"bad chunk size line {size_line[:80]!r}")
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {size_line[:80]!r}") from None
                if size == 0:
                    return
                data = await self.reader.readexactly(size + 2)  # the chunk and its CRLF
                yield data[:-2]
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await self.reader.read(min(left, 1 << 16))
                if not data:
                    raise ProtocolError(f"the connection closed {left} bytes before the body's end")
                left -= len(data)
                yield data
        else:
            while data := await self.reader.read(1 << 16):
                yield data

    async def aread(self) -> bytes:
        return b"".join([part async for part in self.aiter_bytes()])


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, path with query) of an ``http://`` URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http:// URL: {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, parts.port or 80, path


@contextlib.asynccontextmanager
async def post(url: str, body: bytes, content_type: str = "application/json") -> AsyncIterator[Response]:
    """POST ``body`` on a new connection (closed on leaving); yields the response once its headers
    are read."""
    host, port, path = split_url(url)
    reader, writer = await asyncio.open_connection(host, port, limit=MAX_LINE)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                     b"Accept: text/event-stream, application/json\r\nConnection: close\r\n\r\n%s"
                     % (path.encode(), host.encode(), port, content_type.encode(), len(body), body))
        status_line = await reader.readline()
        fields = status_line.split(None, 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
            raise ProtocolError(f"bad status line {status_line[:80]!r}")
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n"):
            if not line:
                raise ProtocolError("the connection closed inside the response headers")
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise ProtocolError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        yield Response(int(fields[1]), headers, reader)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
