"""The OpenAI-compatible HTTP app over an AsyncLLM: /v1/completions, /v1/chat/completions (plain and SSE),
/v1/models, /health, /tokenize, /detokenize, /version and /metrics, with vLLM's error shape (400 for bad
input, 401 without the API key, 404 for an unknown model, 429 when the waiting queue is full)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from graphrunner import __version__
from graphrunner.async_llm import AsyncLLM, EngineDead, QueueFull
from graphrunner.chat import render_chat
from graphrunner.outputs import CompletionOutput, RequestOutput
from graphrunner.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from graphrunner.server.responses import (
    ChoiceStream,
    TokenText,
    chat_choice,
    chat_logprobs,
    completion_choice,
    error_body,
    legacy_logprobs,
    new_id,
    now,
    usage,
)
from graphrunner.server.serving import ClientDisconnected, collect, open_streams, stream_chunks


class ModelNotFound(Exception):
    pass


def _error(message: str, kind: str, code: int, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=code, headers=headers)


class ApiKeyMiddleware:
    """Every /v1 route answers 401 without `Authorization: Bearer <key>` (a pure ASGI middleware: streams and
    disconnect detection pass through untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                await _error("Unauthorized: missing or wrong API key", "AuthenticationError", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc and not loc[0].isdigit() else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(message, "BadRequestError", 400, param)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return _error(" ".join(str(exc).split()), "BadRequestError", 400)

    @app.exception_handler(ModelNotFound)
    async def _no_model(_: Request, exc: ModelNotFound) -> JSONResponse:
        return _error(f"The model `{exc}` does not exist.", "NotFoundError", 404, "model")

    @app.exception_handler(QueueFull)
    async def _full(_: Request, exc: QueueFull) -> JSONResponse:
        return _error(str(exc), "TooManyRequests", 429, headers={"Retry-After": "1"})

    @app.exception_handler(EngineDead)
    async def _dead(_: Request, exc: EngineDead) -> JSONResponse:
        return _error(str(exc), "ServiceUnavailable", 503)


class _Server:
    """The route bodies, sharing the engine, the served model name and token -> text."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm, self.model_name = llm, model_name
        self.tokenizer = llm.get_tokenizer()
        self.text = TokenText(self.tokenizer)
        self.max_model_len = llm.config.scheduler.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(model)

    def _hold(self, stop: Any) -> int:
        return max((len(s) for s in stop or []), default=1) - 1

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        params = body.to_sampling_params(self.llm.get_default_sampling_params())
        rid = body.request_id or new_id("cmpl")
        opened = await open_streams(self.llm, body.prompts(), params, rid)
        head = {"id": rid, "object": "text_completion", "created": now(), "model": self.model_name}
        if body.stream:
            offsets: dict[int, int] = {}

            def build(index: int, out: RequestOutput, comp: CompletionOutput, piece: tuple[str, int, int],
                      state: ChoiceStream) -> dict[str, Any]:
                text, start, end = piece
                if body.echo and not state.started:
                    text = (out.prompt or self.tokenizer.decode(out.prompt_token_ids)) + text
                logprobs = None
                if params.logprobs is not None and comp.logprobs is not None:
                    logprobs = legacy_logprobs(comp.token_ids[start:end], list(comp.logprobs[start:end]),
                                               params.logprobs, self.text, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(text)
                return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason}

            chunks = stream_chunks(opened, params.n, self._hold(params.stop), head, build, body.include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        finals = await collect(opened, request)
        choices = [completion_choice(out, comp, i * params.n + comp.index, body.echo, params.logprobs, self.text)
                   for i, out in enumerate(finals) for comp in out.outputs]
        return JSONResponse({**head, "choices": choices, "usage": usage(finals)})

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        params = body.to_sampling_params(self.llm.get_default_sampling_params())
        prompts = render_chat(self.tokenizer, body.messages, chat_template=body.chat_template,
                              add_generation_prompt=body.add_generation_prompt,
                              continue_final_message=body.continue_final_message,
                              chat_template_kwargs=body.chat_template_kwargs)
        rid = body.request_id or new_id("chatcmpl")
        opened = await open_streams(self.llm, prompts, params, rid)
        head = {"id": rid, "object": "chat.completion", "created": now(), "model": self.model_name}
        if body.stream:
            head["object"] = "chat.completion.chunk"

            def build(index: int, out: RequestOutput, comp: CompletionOutput, piece: tuple[str, int, int],
                      state: ChoiceStream) -> dict[str, Any]:
                text, start, end = piece
                logprobs = None
                if params.logprobs is not None and comp.logprobs is not None:
                    logprobs = chat_logprobs(comp.token_ids[start:end], list(comp.logprobs[start:end]),
                                             params.logprobs, self.text)
                return {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                        "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}

            first = [{"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]} for i in range(len(opened) * params.n)]
            chunks = stream_chunks(opened, params.n, self._hold(params.stop), head, build, body.include_usage, first)
            return StreamingResponse(chunks, media_type="text/event-stream")
        finals = await collect(opened, request)
        choices = [chat_choice(comp, i * params.n + comp.index, params.logprobs, self.text)
                   for i, out in enumerate(finals) for comp in out.outputs]
        return JSONResponse({**head, "choices": choices, "usage": usage(finals)})

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if body.messages is not None:
            ids = render_chat(self.tokenizer, body.messages,
                              add_generation_prompt=body.add_generation_prompt)[0]["prompt_token_ids"]
        else:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        vocab = self.llm.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}), got {bad[:5]}")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": now(), "owned_by": "graphrunner",
                "root": str(self.llm.config.model_dir), "parent": None, "max_model_len": self.max_model_len,
                "permission": []}
        return {"object": "list", "data": [card]}


def build_app(llm: AsyncLLM, served_model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """The FastAPI app; its lifespan shuts the AsyncLLM down (in-flight requests aborted) when the server stops."""
    server = _Server(llm, served_model_name or str(llm.config.model_dir))
    llm.set_metrics_label("model_name", server.model_name)  # vLLM labels its metrics with the served name

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(llm.shutdown, True)

    app = FastAPI(title="graphrunner", version=__version__, lifespan=lifespan)
    app.state.server = server
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return server.detokenize(body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = await asyncio.to_thread(llm.prometheus_text)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
