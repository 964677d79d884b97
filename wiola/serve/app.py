"""The HTTP app (Starlette; served by uvicorn): OpenAI's completion and chat endpoints, models,
health, tokenize/detokenize, and the playground page at ``/``.

Bodies are read with a size limit (by ``Content-Length`` first, then by the bytes streamed, so
an oversized body is refused before it is all read), decoded as UTF-8 and parsed as JSON; each
failure is a 4xx in OpenAI's error JSON. Streaming responses are server-sent events: ``data:
{chunk}`` lines, then ``data: [DONE]``. A client that goes away cancels its jobs (their rows
leave before the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from wiola.fast.rows import RowRequest, RowToken
from wiola.serve.engine import Engine, Job
from wiola.serve.protocol import (
    BODY_SECONDS,
    ApiError,
    Sampling,
    check_lengths,
    new_id,
    now,
    parse_chat,
    parse_completion,
    room_after,
)
from wiola.text_stream import TextStream

MAX_BODY = 1 << 20  # bytes: a request body past this is refused with 413
DISCONNECT_POLL = 0.5  # seconds between checks that the client is still there, tokens flowing or not


class Server:
    """What the routes share: the model's tokenizer, the engine, the names and limits."""

    def __init__(
        self, engine: Engine, tokenizer, model_name: str, max_len: int, max_body: int = MAX_BODY,
        body_seconds: float = BODY_SECONDS,
    ) -> None:  # fmt: skip
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_len, self.max_body, self.body_seconds = max_len, max_body, body_seconds
        self.vocab_size = engine.rows.model.config.vocab_size

    # ------------------------------------------------------------------ jobs
    def jobs(self, prompts: list[list[int]], s: Sampling, max_tokens: int, queue: asyncio.Queue) -> list[Job]:
        """One job per (prompt, sample), choice index ``prompt * n + sample``; sample ``i`` seeded ``seed + i``."""
        out = []
        for p, ids in enumerate(prompts):
            for i in range(s.n):
                request = RowRequest(
                    prompt=ids, max_new_tokens=max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                    seed=None if s.seed is None else s.seed + i, eos_token_id=self.tokenizer.eos_token_id,
                    logprobs=s.logprobs or 0,
                )  # fmt: skip
                out.append(Job(request, queue, index=p * s.n + i))
        return out

    def streams(self, jobs: list[Job], stops: list[str]) -> dict[Job, TextStream]:
        """Each job's ``TextStream`` (its text so far, the token offsets, the exact final text)."""
        return {job: TextStream(self.tokenizer, stops) for job in jobs}

    async def run(
        self, jobs: list[Job], streams: dict[Job, TextStream], request: Request
    ) -> AsyncIterator[tuple[Job, str, Any]]:
        """Submit ``jobs`` and yield ``(job, new text, token or finish reason)`` as their tokens
        arrive (each token's text goes through ``streams[job]``, whose ``offset`` is the token's
        while its event is consumed); each ends with ``(job, rest of its text, "stop" | "length")``.
        Cancels every job still running when the consumer stops early or the client goes away
        (asked at least every ``DISCONNECT_POLL`` seconds, also while tokens keep arriving)."""
        pending = {job for job in jobs if job.request.max_new_tokens > 0}
        for job in jobs:
            if job not in pending:
                yield job, "", "length"
        for job in pending:
            self.engine.submit(job)
        queue = jobs[0].queue if jobs else None
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_POLL
        try:
            while pending:
                got = None
                wait = check_at - loop.time()
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        got = await asyncio.wait_for(queue.get(), wait)
                if loop.time() >= check_at:
                    if await request.is_disconnected():
                        return
                    check_at = loop.time() + DISCONNECT_POLL
                if got is None:
                    continue
                job, item = got
                if job not in pending or item is None:
                    continue
                if isinstance(item, Exception):
                    raise ApiError(str(item), status=400 if isinstance(item, ValueError) else 500)
                async for event in self._token(job, item, streams[job], pending):
                    yield event
        finally:
            for job in pending:
                self.engine.cancel(job)

    async def _token(self, job: Job, token: RowToken, stream: TextStream, pending: set[Job]):
        if token.finish_reason == "stop":  # the eos token: counted, not part of the text
            pending.discard(job)
            stream.add_textless()  # its offset: the text's end
            yield job, "", token
            yield job, stream.rest(), "stop"
            return
        delta = stream.add(token.token)
        yield job, delta, token
        if stream.stopped:
            pending.discard(job)
            self.engine.cancel(job)
            yield job, "", "stop"
        elif token.finish_reason == "length":
            pending.discard(job)
            yield job, stream.rest(), "length"

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def logprobs_entry(self, token: RowToken, offset: int) -> dict[str, Any]:
        """A token of a legacy completion's ``logprobs``: its text, log-probability, best
        alternatives by text, and ``offset`` (where its text begins in the choice's text)."""
        # OpenAI's top_logprobs is keyed by text, and distinct tokens can decode to one text (the
        # byte tokens of a split character all read "\ufffd"): such a text keeps its best log-probability.
        top: dict[str, float] = {}
        for t, lp in sorted(token.top, key=lambda pair: -pair[1]):
            top.setdefault(self.token_text(t), lp)
        return {"token": self.token_text(token.token), "logprob": token.logprob, "top": top, "offset": offset}

    def chat_logprobs_entry(self, token: RowToken) -> dict[str, Any]:
        """A token of a chat choice's ``logprobs.content``: OpenAI's ``{token, logprob, bytes,
        top_logprobs: [{token, logprob, bytes}, ...]}``, the alternatives best first."""

        def one(t: int, lp: float) -> dict[str, Any]:
            raw = self.tokenizer.token_bytes(t)  # part of a character too; None where unknown
            return {"token": self.token_text(t), "logprob": lp, "bytes": None if raw is None else list(raw)}

        return {**one(token.token, token.logprob), "top_logprobs": [one(t, lp) for t, lp in token.top]}


async def read_json(request: Request, limit: int, seconds: float) -> Any:
    """The body as JSON, refusing (``ApiError``) more than ``limit`` bytes before reading them
    all, a body that has not arrived within ``seconds`` (408: the connection is not held, and a
    shutdown does not wait on it), bytes that are not UTF-8, and text that is not JSON. A client
    that disconnects before its body ends gets 499, with no traceback in the log."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise ApiError(f"the request body of {length} bytes is over the limit of {limit} bytes", status=413)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(f"the request body is over the limit of {limit} bytes", status=413)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(f"the request body did not arrive within {seconds:g} s", status=408) from None
    except ClientDisconnect:
        raise ApiError("the client disconnected before its request body ended", status=499) from None
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"the request body is not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start})") from None
    if not text.strip():
        raise ApiError("the request body is empty: send a JSON object")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ApiError(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # an integer past Python's digit limit for str -> int
        raise ApiError(f"the request body holds a number that cannot be read: {e}") from None
    if _depth_over(body, MAX_DEPTH):
        raise ApiError(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)")
    where = _lone_surrogate(body)
    if where is not None:  # JSON's "\ud800" escape: a str that no tokenizer, and no UTF-8, can take
        path, code = where
        raise ApiError(
            f"{path or 'the request body'} holds a lone UTF-16 surrogate ({code}): text must be valid Unicode",
            None if path.startswith("a key") else path.split("[")[0].split(".")[0] or None,
        )
    return body


MAX_DEPTH = 32  # nesting of a request body: OpenAI's requests need a few levels


def _depth_over(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than ``limit`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """``(where, "\\udXXX")`` for the first string in a JSON value holding a lone surrogate, e.g.
    ``("messages[0].content", "\\ud83d")`` (a key: ``"a key in messages[0]"``); None when all are Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # the only str UTF-8 refuses: one holding a surrogate
            return path, f"\\u{ord(value[e.start]):04x}"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and (found := _lone_surrogate(key, f"a key in {path}" if path else "a key")):
            return found
        found = _lone_surrogate(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (an unknown path: 404, a method a path does not take: 405) in
    OpenAI's error JSON, as every other refusal of the server."""
    status = getattr(exc, "status_code", 500)
    what = {404: f"no endpoint {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    response = _error(ApiError(what.get(status, str(getattr(exc, "detail", exc))), status=status))
    response.headers.update(getattr(exc, "headers", None) or {})  # 405's Allow
    return response


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------- completions
async def completions(request: Request) -> Response:
    server: Server = request.app.state.server
    try:
        body = await read_json(request, server.max_body, server.body_seconds)
        req = parse_completion(body, server.tokenizer.encode, server.vocab_size, server.max_len)
    except ApiError as e:
        return _error(e)
    s = req.sampling
    jobs = server.jobs(req.prompts, s, s.max_tokens, asyncio.Queue())
    head = {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": server.model_name}
    echo = [req.prompt_texts[j.index // s.n] or server.tokenizer.decode(req.prompts[j.index // s.n]) for j in jobs]
    # the choice's text before its generated text: where the tokens' text_offset begin
    prefix = {j: echo[k] if req.echo else "" for k, j in enumerate(jobs)}
    if s.stream:
        return StreamingResponse(
            _stream_completion(server, request, req, jobs, head, prefix), media_type="text/event-stream"
        )
    done = await _run_to_end(server, request, jobs, s.stop, prefix, logprobs=s.logprobs is not None)
    if isinstance(done, Response):
        return done
    choices = [
        {"text": done.texts[j], "index": j.index,
         "logprobs": _logprobs(done.logprobs[j], len(prefix[j])) if s.logprobs is not None else None,
         "finish_reason": done.finish[j]}
        for j in jobs
    ]  # fmt: skip
    return JSONResponse({**head, "choices": choices, "usage": _usage(req.prompts, done.tokens)})


@dataclass
class _Done:
    """What a non-streaming request's jobs produced, each to its end."""

    texts: dict[Job, str]
    finish: dict[Job, str]  # "stop" | "length"
    tokens: int  # new tokens over every job
    logprobs: dict[Job, list[dict]]  # ``Server.logprobs_entry`` per token (empty unless asked for)


async def _run_to_end(
    server: Server, request: Request, jobs: list[Job], stops: list[str], prefix: dict[Job, str], *,
    logprobs: bool, chat: bool = False,
) -> _Done | Response:  # fmt: skip
    """Run ``jobs`` to their end: what they produced (each one's text ``prefix[job]`` followed by
    the exact decoding of its new tokens, cut before a stop string; with ``logprobs``, each
    token's entry, ``Server.chat_logprobs_entry`` if ``chat`` else ``Server.logprobs_entry``), or
    the response to send instead (the error in OpenAI's JSON, or 499 when the client went away)."""
    finish: dict[Job, str] = {}
    logs: dict[Job, list[dict]] = {j: [] for j in jobs}
    streams = server.streams(jobs, stops)
    count = 0
    try:
        async with contextlib.aclosing(server.run(jobs, streams, request)) as events:
            async for job, _, what in events:
                if isinstance(what, str):
                    finish[job] = what
                else:
                    count += 1
                    # chat: the eos has no text, so it is not among the content's tokens (their bytes join to it)
                    if logprobs and not (chat and what.finish_reason == "stop"):
                        offset = streams[job].offset
                        logs[job].append(
                            server.chat_logprobs_entry(what) if chat else server.logprobs_entry(what, offset)
                        )
    except ApiError as e:
        return _error(e)
    if len(finish) < len(jobs):  # the client went away
        return Response(status_code=499)
    return _Done({j: prefix[j] + streams[j].final for j in jobs}, finish, count, logs)


def _logprobs(entries: list[dict], start: int) -> dict[str, Any]:
    """OpenAI's legacy completion ``logprobs`` object over the generated tokens; ``start``: the
    length of the choice's text before them (the echoed prompt), where their offsets begin."""
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [e["top"] for e in entries],
        "text_offset": [start + e["offset"] for e in entries],
    }


def _usage(prompts: list[list[int]], completion: int) -> dict[str, int]:
    """OpenAI's usage: each prompt counted once, whatever ``n``; ``completion`` new tokens over every choice."""
    prompt = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _stream_completion(server: Server, request: Request, req, jobs, head, prefix) -> AsyncIterator[str]:
    s = req.sampling
    completion = 0
    streams = server.streams(jobs, s.stop)
    if req.echo:
        for job in jobs:
            choice = {"text": prefix[job], "index": job.index, "logprobs": None, "finish_reason": None}
            yield _sse({**head, "choices": [choice]})
    try:
        async with contextlib.aclosing(server.run(jobs, streams, request)) as events:
            async for job, delta, what in events:
                finish = what if isinstance(what, str) else None
                logprobs = None
                if not isinstance(what, str):
                    completion += 1
                    if s.logprobs is not None:
                        logprobs = _logprobs([server.logprobs_entry(what, streams[job].offset)], len(prefix[job]))
                if delta or finish or not isinstance(what, str):  # a chunk per token, its text possibly held back
                    choice = {"text": delta, "index": job.index, "logprobs": logprobs, "finish_reason": finish}
                    yield _sse({**head, "choices": [choice]})
    except ApiError as e:
        yield _sse(e.body())
    if s.include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(req.prompts, completion)})
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------- chat
def _chat_prompt(server: Server, messages: list[dict[str, str]]) -> list[int]:
    template = getattr(server.tokenizer, "chat_template", None)
    if not template:
        raise ApiError(
            f"the model {server.model_name!r} has no chat template (its tokenizer_config.json has no "
            "chat_template): use /v1/completions",
            "messages",
        )
    from wiola.chat import apply_chat_template

    try:
        return apply_chat_template(server.tokenizer, messages)
    except ValueError as e:
        raise ApiError(str(e), "messages") from None


async def chat_completions(request: Request) -> Response:
    server: Server = request.app.state.server
    try:
        body = await read_json(request, server.max_body, server.body_seconds)
        req = parse_chat(body)
        prompt = _chat_prompt(server, req.messages)
        s = req.sampling
        max_tokens = room_after(prompt, server.max_len) if s.max_tokens is None else s.max_tokens
        check_lengths([prompt], max_tokens, server.max_len)
    except ApiError as e:
        return _error(e)
    jobs = server.jobs([prompt], s, max_tokens, asyncio.Queue())
    head = {"id": new_id("chatcmpl"), "created": now(), "model": server.model_name}
    if s.stream:
        return StreamingResponse(_stream_chat(server, request, s, jobs, head, prompt), media_type="text/event-stream")
    logprobs = s.logprobs is not None
    done = await _run_to_end(server, request, jobs, s.stop, dict.fromkeys(jobs, ""), logprobs=logprobs, chat=True)
    if isinstance(done, Response):
        return done
    choices = [
        {"index": j.index, "message": {"role": "assistant", "content": done.texts[j]},
         "logprobs": {"content": done.logprobs[j]} if logprobs else None, "finish_reason": done.finish[j]}
        for j in jobs
    ]  # fmt: skip
    return JSONResponse(
        {**head, "object": "chat.completion", "choices": choices, "usage": _usage([prompt], done.tokens)}
    )


async def _stream_chat(server: Server, request: Request, s: Sampling, jobs, head, prompt) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    for job in jobs:
        choice = {"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}  # fmt: skip
        yield _sse({**head, "choices": [choice]})
    count = 0
    try:
        async with contextlib.aclosing(server.run(jobs, server.streams(jobs, s.stop), request)) as events:
            async for job, delta, what in events:
                finish = what if isinstance(what, str) else None
                logprobs = None
                eos = finish is None and what.finish_reason == "stop"  # counted; no text, no content entry
                if finish is None:
                    count += 1
                    if s.logprobs is not None and not eos:  # a chunk per token: that token's entry
                        logprobs = {"content": [server.chat_logprobs_entry(what)]}
                if delta or finish or not (isinstance(what, str) or eos):
                    delta_obj = {"content": delta} if delta else {}
                    choice = {"index": job.index, "delta": delta_obj, "logprobs": logprobs, "finish_reason": finish}
                    yield _sse({**head, "choices": [choice]})
    except ApiError as e:
        yield _sse(e.body())
    if s.include_usage:
        yield _sse({**head, "choices": [], "usage": _usage([prompt], count)})
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------- the rest
def _model_card(request: Request) -> dict[str, Any]:
    server: Server = request.app.state.server
    return {"id": server.model_name, "object": "model", "created": request.app.state.started, "owned_by": "wiola",
            "max_model_len": server.max_len}  # fmt: skip


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}`` (the ``openai`` client's ``models.retrieve``): the served model's
    card, or a 404 naming the one model this server has."""
    name, served = request.path_params["model"], request.app.state.server.model_name
    if name != served:
        return _error(ApiError(f"no model {name!r}: this server serves {served!r}", "model", 404, "model_not_found"))
    return JSONResponse(_model_card(request))


async def health(request: Request) -> Response:
    server: Server = request.app.state.server
    engine = server.engine
    return JSONResponse(
        {"status": "ok", "backend": engine.backend, "live_rows": len(engine.live), "waiting": len(engine.waiting),
         "max_batch": engine.max_batch, "steps": engine.steps, "left_early": engine.left}
    )  # fmt: skip


async def tokenize(request: Request) -> Response:
    server: Server = request.app.state.server
    try:
        body = await read_json(request, server.max_body, server.body_seconds)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ApiError('tokenize takes {"prompt": "text"}', "prompt")
    except ApiError as e:
        return _error(e)
    ids = server.tokenizer.encode(text)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": server.max_len})


async def detokenize(request: Request) -> Response:
    server: Server = request.app.state.server
    try:
        body = await read_json(request, server.max_body, server.body_seconds)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError('detokenize takes {"tokens": [ids]}', "tokens")
        bad = [t for t in ids if not 0 <= t < server.vocab_size]
        if bad:
            raise ApiError(f"token id {bad[0]} is outside [0, {server.vocab_size})", "tokens")
    except ApiError as e:
        return _error(e)
    return JSONResponse({"prompt": server.tokenizer.decode(ids)})


async def playground(request: Request) -> Response:
    page = resources.files("wiola.serve").joinpath("static/index.html").read_text(encoding="utf-8")
    return HTMLResponse(page.replace("{{MODEL}}", html.escape(request.app.state.server.model_name)))


def create_app(server: Server) -> Starlette:
    """The ASGI app; the engine's task starts and stops with the app's lifespan (after uvicorn
    has finished the requests in flight, on SIGTERM)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        server.engine.start()
        yield
        await server.engine.stop()

    routes = [
        Route("/", playground),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/v1/models/{model:path}", model),
        Route("/health", health),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.server = server
    app.state.started = now()
    return app
