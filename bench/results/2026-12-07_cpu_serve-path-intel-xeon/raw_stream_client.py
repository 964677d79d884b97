"""One 900-token greedy stream from `wiola serve` (bf16, 13m-shaped random weights), read by a
socket client that only counts the server-sent events: the time a token, three times.

    python bench/results/2026-12-07_cpu_serve-path-intel-xeon/raw_stream_client.py
"""

import json
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.serve import _checkpoint, _Server

folder = Path(tempfile.mkdtemp())
srv = _Server(_checkpoint(folder / "ck"), "bf16", 8, folder / "log.txt")
host, port = "127.0.0.1", int(srv.url.rsplit(":", 1)[1])


def one(n: int) -> tuple[float, int]:
    body = json.dumps({"prompt": [5] * 16, "max_tokens": n, "temperature": 0, "stream": True}).encode()
    s = socket.create_connection((host, port))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    t0, events = time.perf_counter(), 0
    while True:
        d = s.recv(65536)
        if not d:
            break
        events += d.count(b"data: {")
        if b"[DONE]" in d:
            break
    s.close()
    return time.perf_counter() - t0, events


one(4)
for _ in range(3):
    w, n = one(900)
    print(f"raw client: {n} events in {w:.2f}s = {w / n * 1e3:.2f} ms an event")
srv.stop()
