"""Non-blocking socket I/O for the store, on anyio's readiness waits.

Theory of operation: the store's frames are small and latency-bound, so the driver talks to a
plain non-blocking socket and only awaits readiness when the kernel says "would block"
(``anyio.wait_readable``/``wait_writable``, which run on asyncio and trio alike). A request
whose reply is not yet there costs one send syscall, one failed recv and one readiness wait —
no intermediate stream buffers or per-call task switches.

Cancellation: ``receive`` is atomic (bytes are consumed only by a recv that returns them).
``send`` writes a whole frame or nothing as far as cancellation is concerned: while no byte has
gone out the wait is cancellable; once part of a frame is out the rest is written shielded
(bounded by ``send_timeout``, after which the channel is unusable: a peer that stops reading
for that long is treated as dead), because half a frame would desynchronize the stream.
"""

from __future__ import annotations

import socket

import anyio

__all__ = ["SocketChannel", "set_nodelay"]

_CHUNK = 65536


def set_nodelay(sock: socket.socket) -> None:
    """Disable Nagle: request/reply frames must leave at once."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


class SocketChannel:
    """One connected non-blocking TCP socket with frame-atomic sends."""

    __slots__ = ("_closed", "_lock", "_send_timeout", "sock")

    def __init__(self, sock: socket.socket, *, send_timeout: float = 30.0) -> None:
        sock.setblocking(False)
        set_nodelay(sock)
        self.sock = sock
        self._send_timeout = send_timeout
        self._lock = anyio.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def receive(self) -> bytes:
        """Some bytes (``b""`` at end of stream). Raises ``OSError``/``ClosedResourceError``."""
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                return self.sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                await anyio.wait_readable(self.sock)

    async def send(self, data: bytes) -> None:
        """Write all of ``data`` (one frame); see the module docstring for cancellation."""
        lock = self._lock
        try:
            lock.acquire_nowait()  # the common case: no await, no task switch
        except anyio.WouldBlock:
            await lock.acquire()
        try:
            if self._closed:
                raise anyio.ClosedResourceError
            view = memoryview(data)
            sent = 0
            while sent == 0:
                try:
                    sent = self.sock.send(view)
                except (BlockingIOError, InterruptedError):
                    await anyio.wait_writable(self.sock)  # nothing sent yet: cancellable
            if sent < len(view):
                with anyio.CancelScope(shield=True), anyio.fail_after(self._send_timeout):
                    while sent < len(view):
                        await anyio.wait_writable(self.sock)
                        try:
                            sent += self.sock.send(view[sent:])
                        except (BlockingIOError, InterruptedError):
                            pass
        except TimeoutError:
            self.close()
            raise OSError(f"peer did not drain its socket for {self._send_timeout} s") from None
        finally:
            lock.release()

    def close(self) -> None:
        """Close now; tasks waiting on the socket get ``ClosedResourceError``."""
        if self._closed:
            return
        self._closed = True
        try:
            anyio.notify_closing(self.sock)
        except Exception:  # no waiter registered: nothing to notify
            pass
        try:
            self.sock.close()
        except OSError:
            pass
