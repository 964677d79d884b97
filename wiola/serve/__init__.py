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
from collections.abc import Iterator
from typing import Any

from wiola.serve.protocol import BODY_SECONDS


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
