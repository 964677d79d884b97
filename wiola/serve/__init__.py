"""``wiola serve``: an OpenAI-compatible HTTP server with continuous batching.

- ``wiola.serve.engine``: one asyncio task owns a ``wiola.fast.rows.Rows`` and steps it (one
  step for the whole batch per loop, in a worker thread); requests join and leave between steps.
- ``wiola.serve.app``: the Starlette app (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/tokenize``, ``/detokenize``, the playground at ``/``).
- ``wiola.serve.protocol``: request validation and OpenAI's error JSON.

``serve(model, tokenizer, ...)`` runs it under uvicorn until SIGINT/SIGTERM (requests in flight
finish first).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

from wiola.serve.protocol import BODY_SECONDS


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (``port`` 0: one the system picks; an address with a
    colon: IPv6), made with its protocol named. asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on connections whose socket says it is TCP, and ``socket.create_server``'s
    says 0: its connections kept Nagle on, so on a kept-alive connection a streamed response's
    token events waited for the client's delayed acknowledgement and arrived together about 40 ms
    late. The listening socket has it off too. Raises ``OSError`` where the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if hasattr(socket, "SO_REUSEADDR") and sys.platform != "win32":  # as socket.create_server
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def serve(model: Any, tokenizer: Any, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_batch: int = 8, log_level: str = "info", sock: socket.socket | None = None,
          body_seconds: float = BODY_SECONDS) -> None:  # fmt: skip
    """Serve ``model`` (a ``wiola.fast.WiolaModel``, any weight type, or the reference model) with
    ``tokenizer`` on ``host:port`` with up to ``max_batch`` rows decoding at once; on ``sock``, a
    listening socket, where one is given (``wiola serve`` binds it before the model loads, so a
    port in use is said first and ``--port 0`` can print the port it got). A request body that
    has not arrived within ``body_seconds`` is a 408."""
    import uvicorn

    from wiola.serve.app import Server, create_app
    from wiola.serve.engine import Engine

    class _Uvicorn(uvicorn.Server):
        """SIGINT/SIGTERM: stop accepting, finish the requests in flight, then return (exit 0;
        uvicorn itself re-raises the signal after its shutdown, which would end the process with 143).
        A second signal of either kind stops waiting for them (uvicorn's own: a second SIGINT only)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    engine = Engine(model, max_batch)
    app = create_app(Server(engine, tokenizer, model_name, model.config.max_seq_len, body_seconds=body_seconds))
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None)
    _Uvicorn(config).run(sockets=None if sock is None else [sock])
