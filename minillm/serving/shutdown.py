"""A bounded graceful shutdown for uvicorn: ``GracefulServer``.

On SIGTERM or SIGINT (or ``server.should_exit = True``) uvicorn stops accepting
connections and waits for the ones in flight. Left alone it waits as long as they run:
a request for the rest of an 8192-token context, or one whose client has gone quiet,
keeps the process alive for minutes. ``GracefulServer`` bounds that wait:

    t = 0                 listeners closed; idle keep-alive connections closed
    0 .. grace            requests in flight may finish on their own
    t = grace             ``on_grace_expired()``: the server aborts its requests in flight;
                          each ends at once with finish_reason "abort" (a stream gets its
                          last chunk and [DONE]), and frees its KV blocks
    t = grace + backstop  any task still running is cancelled (uvicorn's own timeout)

so the process exits within ``grace + backstop`` seconds of the signal, at most. A
second Ctrl-C still forces the exit at once, as uvicorn does.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Callable

import uvicorn

logger = logging.getLogger("minillm.serving")

DEFAULT_GRACE_S = 3.0  # serve --shutdown-grace
BACKSTOP_S = 2.0  # after the aborts, how long the handlers get to send their last bytes


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown calls ``on_grace_expired`` after ``grace`` seconds
    and cancels what still runs ``BACKSTOP_S`` later."""

    def __init__(self, config: uvicorn.Config, on_grace_expired: Callable[[], Any] | None = None,
                 grace: float = DEFAULT_GRACE_S):
        if not grace >= 0:
            raise ValueError(f"grace must be a number of seconds >= 0, got {grace!r}")
        config.timeout_graceful_shutdown = grace + BACKSTOP_S
        super().__init__(config)
        self.on_grace_expired = on_grace_expired
        self.grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = None
        if self.on_grace_expired is not None:
            timer = asyncio.get_running_loop().call_later(self.grace, self._expire)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self) -> None:
        n = self.on_grace_expired()
        if n:
            logger.warning("shutdown: aborted %s request(s) still in flight after %.1f s", n, self.grace)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), or a ValueError that says why:
    done before the model loads, so a bad address fails in a second, not after the load."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be an integer in 0..65535 (0 = any free port), got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError, UnicodeError) as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
                         ) from None
    return sock


__all__ = ["GracefulServer", "bind_socket", "DEFAULT_GRACE_S"]
