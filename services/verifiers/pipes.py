"""Reading a child process's pipes and waiting for it from asyncio, for the local sandbox
(services/verifiers/sandbox.py): capped reads that call a kill past the cap, a pidfd wait that does
not reap, and a non-blocking read of what a pipe holds."""

from __future__ import annotations

import asyncio
import os


async def read_capped(stream: asyncio.StreamReader, cap: int, on_overflow) -> tuple[bytes, bool]:
    """Read until EOF keeping at most `cap` bytes; past the cap, call `on_overflow` (a kill)."""
    buf = bytearray()
    while chunk := await stream.read(1 << 16):
        room = cap - len(buf)
        buf += chunk[:room]
        if len(chunk) > room:
            on_overflow()
            while await stream.read(1 << 16):  # discard until the killed group closes the pipe
                pass
            return bytes(buf), True
    return bytes(buf), False


async def pipe_reader(pipe) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """An asyncio reader (and its transport, to close) on a pipe file object."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader, transport


async def exited(pid: int) -> None:
    """Wait for `pid` to exit without reaping it (a pidfd becomes readable at exit)."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def read_all(fd: int) -> bytes:
    """What the pipe `fd` holds now, without blocking."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except BlockingIOError:  # writer still open somewhere: take what is there
        pass
    return b"".join(chunks)
