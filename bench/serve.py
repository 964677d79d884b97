"""The serving benchmark: ``wiola serve`` under 128 requests, concurrent vs one after another.

    python -m bench.serve [--out bench/results/<date>_cpu_serve] [--schemes int8 bf16 fp32]
                          [--requests 128] [--max-tokens 64] [--max-batch 16]

For each weight type, a 13m-shaped model (``WiolaConfig()``, random weights: speed does not
depend on the values) is served by ``python -m wiola serve`` on 127.0.0.1 and a free port. The
same ``--requests`` streamed greedy completions (16-token prompts, ``--max-tokens`` new tokens
each) are sent all at once (continuous batching, up to ``--max-batch`` rows) and then one after
another. Reported per run: aggregate tokens/s (all new tokens / wall time), time to first token
and inter-token latency p50/p99 as the client sees them (server-sent events), and the ratio
concurrent / sequential. The CPU's model and flags and the machine's load average are recorded
with the results (``results.json``, ``results.md``) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkpoint(folder: Path) -> Path:
    """A 13m-shaped model with random weights and a byte-level BPE (only prompt ids and decoding matter)."""
    import torch

    from wiola import WiolaConfig, WiolaModel
    from wiola.tokenizer import train_tokenizer

    torch.manual_seed(0)
    texts = ["Once upon a time there was a little cat who liked to play in the sun with a red ball."] * 50
    model = WiolaModel(WiolaConfig(eos_token_id=None))
    model.save_pretrained(folder, train_tokenizer(texts, 400, show_progress=False))
    return folder


class _Server:
    def __init__(self, checkpoint: Path, scheme: str, max_batch: int, log: Path) -> None:
        import httpx

        self.url = f"http://127.0.0.1:{_free_port()}"
        cmd = [sys.executable, "-m", "wiola", "serve", "--checkpoint", str(checkpoint), "--port", self.url.rsplit(":", 1)[1],
               "--max-batch", str(max_batch), "--log-level", "warning"]  # fmt: skip
        if scheme != "fp32":
            cmd += ["--quantize", scheme]
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"wiola serve exited: {log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("wiola serve did not come up in 300 s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


async def _one(
    client, url: str, prompt: list[int], max_tokens: int, sampling: dict | None = None
) -> tuple[float, list[float], int]:
    """(start, chunk arrival times, tokens) of one streamed completion: greedy, or ``sampling``'s
    temperature and top_p."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(sampling or {})}  # fmt: skip
    start, times, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"][0]["finish_reason"] is None:  # one chunk per generated token
                times.append(time.perf_counter())
    return start, times, tokens


async def _run(
    url: str, prompts: list[list[int]], max_tokens: int, concurrent: bool, sampling: dict | None = None
) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _one(client, url, prompts[0], 4)  # warm: the connection, the first step
        t0 = time.perf_counter()
        if concurrent:
            results = await asyncio.gather(*(_one(client, url, p, max_tokens, sampling) for p in prompts))
        else:
            results = [await _one(client, url, p, max_tokens, sampling) for p in prompts]
        wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    ttft = [r[1][0] - r[0] for r in results if r[1]]
    itl = [b - a for r in results for a, b in zip(r[1], r[1][1:])]
    q = lambda xs, p: statistics.quantiles(xs, n=100, method="inclusive")[p - 1] * 1e3 if len(xs) > 1 else float("nan")
    return {
        "requests": len(prompts), "tokens": tokens, "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1),
        "ttft_ms_p50": round(q(ttft, 50), 2), "ttft_ms_p99": round(q(ttft, 99), 2),
        "itl_ms_p50": round(q(itl, 50), 2), "itl_ms_p99": round(q(itl, 99), 2),
    }  # fmt: skip


def _table(rows: list[dict]) -> str:
    head = "| weights | mode | requests | new tokens | wall s | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | concurrent / sequential |"
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        ratio = f"{r['speedup']:.2f}×" if "speedup" in r else ""
        lines.append(
            f"| {r['scheme']} | {r['mode']} | {r['requests']} | {r['tokens']} | {r['wall_s']} | {r['tok_per_s']} | "
            f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['itl_ms_p50']} / {r['itl_ms_p99']} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    today = datetime.date.today().isoformat()
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / f"{today}_cpu_serve")
    p.add_argument("--schemes", nargs="+", default=["int8", "bf16", "fp32"], choices=["int8", "bf16", "fp32"])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy; else sampled")
    p.add_argument("--top-p", type=float, default=None, help="the nucleus of sampled requests (default: none)")
    p.add_argument("--note", default="", help="a line for the results (e.g. what else ran on the machine)")
    args = p.parse_args(argv)
    from wiola.fast.decode_step_cpu import cpu_info, describe

    args.out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    meta = {"date": today, "cpu_model": cpu["name"], "cpu_flags": cpu["flags"], "machine": platform.machine(),
            "cores": os.cpu_count(), "load_average_before": os.getloadavg(), "step": describe(),
            "requests": args.requests, "max_tokens": args.max_tokens, "prompt_tokens": PROMPT_TOKENS,
            "max_batch": args.max_batch, "temperature": args.temperature, "top_p": args.top_p,
            "note": args.note}  # fmt: skip
    sampling = {"temperature": args.temperature} | ({} if args.top_p is None else {"top_p": args.top_p})
    prompts = [[(37 * i + 11 * j) % 380 + 4 for j in range(PROMPT_TOKENS)] for i in range(args.requests)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = _checkpoint(Path(tmp) / "wiola-13m-random")
        for scheme in args.schemes:
            server = _Server(checkpoint, scheme, args.max_batch, args.out / f"server-{scheme}.log")
            try:
                conc = asyncio.run(_run(server.url, prompts, args.max_tokens, True, sampling))
                seq = asyncio.run(_run(server.url, prompts, args.max_tokens, False, sampling))
            finally:
                server.stop()
            conc["speedup"] = conc["tok_per_s"] / seq["tok_per_s"]
            for mode, r in (("concurrent", conc), ("sequential", seq)):
                rows.append({"scheme": scheme, "mode": mode, **r})
                print(f"{scheme:5} {mode:10} {r['tok_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_ms_p50']} ms  "
                      f"ITL p50 {r['itl_ms_p50']} ms", flush=True)  # fmt: skip
    meta["load_average_after"] = os.getloadavg()
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    md = [f"# wiola serve: {args.requests} streamed requests, concurrent vs sequential ({today})", "",
          f"CPU: {meta['cpu_model']} ({os.cpu_count()} cores), flags: {cpu['flags']}", f"Step: {meta['step']}",
          f"Load average before / after: {meta['load_average_before']} / {meta['load_average_after']}",
          f"Sampling: {sampling}", f"{args.note}", "", _table(rows), ""]  # fmt: skip
    (args.out / "results.md").write_text("\n".join(md))
    print("\n" + _table(rows))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
