"""The HTTP routes of kestrel serve (FastAPI): /health, /v1/models, /v1/completions and /v1/chat/completions, each
answer and stream in OpenAI's shapes, vLLM's /tokenize and /detokenize, and Prometheus' /metrics; every error as
OpenAI's error object. Every route but /health needs the API key, where one is set.

A request is checked in this order: its key (401), its size (413), its body (400), its model (404), the server's
state (503 while loading or stopping), its prompt and limits (400), room in the batch (429). A client that goes away
cancels its sequence, whose KV slot is freed at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import statistics
import time
import uuid

import attrs

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kestrel_core.engine.plan import bytes_streamed
from kestrel_core.serve import protocol, tokens, tool_calls
from kestrel_core.serve.echo import Echo, joined
from kestrel_core.serve.generation import Generation, GenerationFailed, Piece, merged
from kestrel_core.serve.logprobs import LogprobText
from kestrel_core.serve.metrics import CountResponses
from kestrel_core.serve.origins import LOOPBACK_NAMES, OriginGuard
from kestrel_core.serve.protocol import APIError, ChatRequest, CompletionRequest
from kestrel_core.serve.service import READY, Service

log = logging.getLogger("kestrel.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may hold the chunks back


BODY_TIMEOUT_S = 60.0  # the whole body must arrive within this: a client that stalls mid-body holds no connection forever


def create_app(service: Service, api_key: str | None = None, max_body: int = 4 * 2**20,
               body_timeout: float = BODY_TIMEOUT_S, hosts: frozenset[str] | None = LOOPBACK_NAMES,
               origins: frozenset[str] | None = None) -> FastAPI:
    """``hosts``: the Host names answered (None: any); ``origins``: the browser origins given CORS headers (None:
    none); see ``origins.OriginGuard``."""
    app = FastAPI(title="kestrel", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(OriginGuard, hosts=hosts, origins=origins)
    app.add_middleware(CountResponses, metrics=service.metrics)  # outermost: the guard's refusals are counted too

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        log.info("%s %s %d: %s", request.method, request.url.path, exc.status, exc.message)
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # an unknown route, a wrong method
        message = {404: f"no route {request.url.path}; the routes are /health, /v1/models, /v1/completions, "
                        "/v1/chat/completions, /tokenize, /detokenize and /metrics",
                   405: f"{request.method} is not allowed on {request.url.path}"}
        body = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail))).body()
        return JSONResponse(body, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):  # the server logs the traceback once this returns
        log.error("%s %s 500: %s", request.method, request.url.path, type(exc).__name__)
        return JSONResponse(_internal().body(), 500)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        too_big = APIError(413, f"the request body is over this server's limit of {max_body:,} bytes",
                           code="body_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            raise too_big  # refused before reading a byte of it
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():  # a body without a length is counted as it comes
                size += len(chunk)
                if size > max_body:
                    raise too_big
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), body_timeout)
        except ClientDisconnect:  # gone before its body arrived: no one hears the answer, and it is no server error
            raise APIError(400, "the client disconnected before its request body arrived") from None
        except asyncio.TimeoutError:  # a slow-loris body, or a Content-Length above what was sent
            raise APIError(408, f"the request body did not arrive within {body_timeout:g} s ({size:,} bytes came); "
                           "send the whole body, and a Content-Length that matches it", code="body_timeout") from None
        return b"".join(chunks)

    @app.get("/health")
    async def health():
        state = service.health
        return JSONResponse({"status": "ok" if state == READY else state, **service.stats()},
                            200 if state == READY else 503)

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        return protocol.models(service.name, service.created)

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request):
        authorize(request)
        service.check_model(name)
        return protocol.model_card(service.name, service.created)

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request)
        body, media_type = service.metrics.exposition()
        return Response(body, media_type=media_type)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await token_request(request, tokens.TokenizeRequest)
        if req.chat:
            service.check_chat()
        return await asyncio.to_thread(tokens.tokenize, req, service.model.tokenizer, service.template,
                                       service.max_seq)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await token_request(request, tokens.DetokenizeRequest)
        return await asyncio.to_thread(tokens.detokenize, req, service.model.tokenizer,
                                       service.model.config.vocab_size)

    async def token_request(request: Request, kind):
        """A /tokenize or /detokenize body, checked as a generation's is, for a ready model with a tokenizer."""
        authorize(request)
        req = tokens.parse(await read_body(request), kind)
        if req.model is not None:
            service.check_model(req.model)
        service.check_ready()
        if service.model.tokenizer is None:  # a server does not load such a model; kept should that change
            raise APIError(501, f"{service.model.no_tokenizer()}, so this server cannot tokenize or detokenize",
                           "server_error", code="no_tokenizer")
        return req

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatRequest)

    async def generate(request: Request, kind):
        arrived = time.monotonic()
        authorize(request)
        req = protocol.parse(await read_body(request), kind)
        service.check_model(req.model)
        service.check_ready()
        plan = await asyncio.to_thread(service.plan, req)
        gens = service.start(plan)
        answer = Answer(service, req, gens, request.url.path, arrived, plan["echo"])
        if req.stream:
            return EventStream(answer)
        return JSONResponse(await answer.whole(request))

    return app


def _internal() -> APIError:
    return APIError(500, "the server failed on this request (the error is in the server's log)", "server_error",
                    code="internal_error")


class Answer:
    """One request's answer, of its ``n`` choices (a generation each): whole, or as server-sent events; either logs one
    line when it ends."""

    def __init__(self, service: Service, req, gens: list[Generation], path: str, arrived: float | None = None,
                 echo: Echo | None = None):
        """``arrived``: when the request came (``time.monotonic``; None: now), where its time and its first token's
        are measured from; ``echo``: the prompt, laid before each choice's text (completions' ``echo``)."""
        self.service, self.req, self.gens, self.path, self.echo = service, req, gens, path, echo
        self.chat = isinstance(req, ChatRequest)
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.t0 = time.monotonic() if arrived is None else arrived
        self.ended = False
        self.logprobs = LogprobText(service.model.tokenizer) if req.top_count is not None else None
        self.tools = self.chat and req.tool_defs is not None  # a reply may hold tool calls: read them from its text
        self.scores_only = req.scores_only  # the prompt back and nothing of the token drawn after it

    def kept(self, gen: Generation) -> int:
        """How many of ``gen``'s tokens the answer gives (none where it scores the prompt alone)."""
        return 0 if self.scores_only else len(gen.tokens)

    def usage(self) -> dict:
        """The prompt once, and every choice's tokens (as OpenAI counts ``n``)."""
        return protocol.usage(self.gens[0].prompt_tokens, sum(self.kept(gen) for gen in self.gens))

    def cut(self, why: str) -> None:
        for gen in self.gens:
            gen.cut(why)

    def _logprobs(self, gen: Generation, first: int = 0, count: int | None = None) -> dict | None:
        """The OpenAI logprobs of ``count`` of ``gen``'s tokens from ``first`` (None: to the end), where asked."""
        if self.logprobs is None:
            return None
        last = len(gen.tokens) if count is None else first + count
        if self.chat:
            return self.logprobs.chat(gen.logprobs[first:last])
        out = self.logprobs.completion(gen.logprobs[first:last], gen.offsets[first:last])
        return self.echo.before(out) if self.echo is not None else out

    def _echoed(self, gen: Generation) -> tuple[str, dict | None]:
        """The prompt's text and its tokens' logprobs (where asked), once the sequence is past its prompt."""
        if self.logprobs is None:
            return self.echo.text, None
        return self.echo.text, self.echo.logprobs(self.logprobs, gen.seq.prompt_logprobs)

    async def whole(self, request: Request) -> dict:
        """Every piece of every choice, then the answer; a client gone before it is ready cancels the sequences."""
        watch = asyncio.create_task(_on_disconnect(request, lambda: self.cut("the client disconnected")))

        async def text(gen: Generation) -> str:
            return "".join([piece.text async for piece in gen.pieces()])

        try:
            texts = await asyncio.gather(*(text(gen) for gen in self.gens), return_exceptions=True)
            failed = next((t for t in texts if isinstance(t, BaseException)), None)
            if isinstance(failed, GenerationFailed):
                raise APIError(500, f"generation failed: {failed}", "server_error", code="generation_failed")
            if failed is not None:
                raise failed
        finally:
            watch.cancel()
            self.end()
        ids, key = self.req.return_token_ids, "message" if self.chat else "text"
        choices = []
        for i, (gen, t) in enumerate(zip(self.gens, texts)):
            value, reason, logprobs, tokens = t, gen.finish_reason, self._logprobs(gen), list(gen.tokens)
            if self.chat:
                content, calls = tool_calls.parse(t, self.req.call_limit) if self.tools else (t, [])
                value, reason = protocol.message(content, calls), ("tool_calls" if calls else reason)
            elif self.scores_only:
                value, logprobs = self._echoed(gen)
                reason, tokens = "length", []
            elif self.echo is not None:
                text, prompt_logprobs = self._echoed(gen)
                value = text + value
                logprobs = joined(prompt_logprobs, logprobs) if logprobs is not None else None
            choices.append(protocol.choice(i, key, value, reason, tokens if ids else None,
                                           list(gen.seq.request.prompt_ids) if ids else None, logprobs))
        make = protocol.chat if self.chat else protocol.completion
        return make(self.id, self.created, self.service.name, choices, self.usage())

    async def stream(self):
        """``data: {chunk}`` events, each of one choice (tagged with its index), each choice's last with its finish
        reason (and a usage chunk where asked), then ``data: [DONE]``. A client that goes away cancels the generator
        here, and with it the sequences."""
        usage_field, ids = self.req.include_usage, self.req.return_token_ids
        make = protocol.chat_chunk if self.chat else protocol.completion_chunk
        key = "delta" if self.chat else "text"

        def chunk(index: int, value, reason: str | None = None, piece: Piece | None = None) -> str:
            logprobs = self._logprobs(self.gens[index], piece.first, len(piece.token_ids)) if piece else None
            one = protocol.choice(index, key, value, reason, piece.token_ids if piece and ids else None,
                                  logprobs=logprobs)
            return _event(make(self.id, self.created, self.service.name, one, usage_field))

        try:
            if self.chat:
                for i in range(len(self.gens)):
                    yield chunk(i, {"role": "assistant", "content": ""})
            # With tools: each reply read as it comes (content sent as it is written, each call once it is whole);
            # the pieces whose text is held ride the next chunk sent with their ids and logprobs
            readers = {i: tool_calls.Reader(self.req.call_limit) for i in range(len(self.gens))} if self.tools else {}
            held: dict[int, list[Piece]] = {i: [] for i in range(len(self.gens))}
            calls_sent = dict.fromkeys(range(len(self.gens)), 0)

            def read(i: int, events: list) -> list[str]:
                out = []
                for kind, value in events:
                    if kind == "content":
                        delta = {"content": value}
                    else:
                        delta = {"tool_calls": [{"index": calls_sent[i], **value}]}
                        calls_sent[i] += 1
                    out.append(chunk(i, delta, None, _joined(held[i])))
                    held[i].clear()
                return out

            echoed: set[int] = set()
            async for i, piece in merged(self.gens, every_id=bool(ids)):
                if self.echo is not None and i not in echoed:  # its prompt went through: the prompt first
                    echoed.add(i)
                    text, prompt_logprobs = self._echoed(self.gens[i])
                    one = protocol.choice(i, key, text, None, [] if ids else None, logprobs=prompt_logprobs)
                    yield _event(make(self.id, self.created, self.service.name, one, usage_field))
                if self.scores_only:  # the prompt went out above; the token drawn after it does not
                    if piece is None:
                        yield chunk(i, "", "length")
                elif piece is not None and self.tools:
                    held[i].append(piece)
                    for event in read(i, readers[i].push(piece.text)):
                        yield event
                elif piece is None and self.tools:  # the reply is whole: what was held, then its finish reason
                    for event in read(i, readers[i].finish()):
                        yield event
                    reason = "tool_calls" if readers[i].calls else self.gens[i].finish_reason
                    yield chunk(i, {}, reason, _joined(held[i]))
                elif piece is None:
                    yield chunk(i, {} if self.chat else "", self.gens[i].finish_reason)
                else:
                    yield chunk(i, {"content": piece.text} if self.chat else piece.text, None, piece)
            if usage_field:
                obj = "chat.completion.chunk" if self.chat else "text_completion"
                yield _event(protocol.usage_chunk(self.id, self.created, self.service.name, obj, self.usage()))
            yield "data: [DONE]\n\n"
        except GenerationFailed as exc:
            log.error("%s: generation failed: %s", self.path, exc)
            yield _event(APIError(500, f"generation failed: {exc}", "server_error", code="generation_failed").body())
        except Exception:  # after the 200 went out, an error can only be an event: the traceback stays in the log
            log.exception("%s: the stream failed", self.path)
            yield _event(_internal().body())
        finally:
            self.end()

    def end(self) -> None:
        """Cancel the sequences where they still run (the client went away), forget them, count the request in the
        metrics and log its line: tokens, ms/token, bytes streamed per token. Once."""
        if self.ended:
            return
        self.ended = True
        self.cut("the client disconnected")  # a no-op for those that are done
        for gen in self.gens:
            self.service.done(gen)
        gens, first = self.gens, self.gens[0]
        cut = next((gen.why_cut for gen in gens if gen.why_cut), None)
        reasons = sorted({gen.finish_reason or "ended" for gen in gens})
        how = f"cut: {cut}" if cut else "/".join(reasons)
        choices = f" in {len(gens)} choices" if len(gens) > 1 else ""
        line = (f"{self.path}: {first.prompt_tokens} prompt + {sum(self.kept(gen) for gen in gens)} completion tokens"
                f"{choices} ({how})")
        res, streamed = first.result, None
        if res is not None and res.decode_ms:
            streamed = statistics.fmean(bytes_streamed(p) for p in res.per_token) if res.per_token else 0.0
            line += f", {res.ms_per_token:.2f} ms/token, {_size(streamed)} streamed/token"
        self.service.metrics.ended(first.prompt_tokens, [gen.token_times[:self.kept(gen)] for gen in gens], self.t0,
                                   streamed)
        log.info("%s, %.2f s", line, time.monotonic() - self.t0)


def _joined(pieces: list[Piece]) -> Piece | None:
    """Held pieces as one (their text, their ids from the first's), or None where there are none."""
    if not pieces:
        return None
    return attrs.evolve(pieces[0], text="".join(p.text for p in pieces),
                        token_ids=[t for p in pieces for t in p.token_ids])


class EventStream(StreamingResponse):
    """An answer's events, whose sequence is cancelled however the response ends: a client gone before the first
    chunk leaves the stream's generator unstarted, so its own ``finally`` would never run."""

    def __init__(self, answer: Answer):
        super().__init__(answer.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.answer.end()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(',', ':'))}\n\n"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    return f"{n:,.2f} GiB"


async def _on_disconnect(request: Request, then) -> None:
    """Wait for the client to go away (the body is read: what comes next is the disconnect), then call ``then``."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            then()
            return
