"""Running OpenAI requests on an AsyncLLM: open (and validate) one stream per prompt, collect the final outputs
(aborting if the client goes away), or turn the outputs into SSE chunks for completions and chat."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from graphrunner.async_llm import AsyncLLM
from graphrunner.outputs import CompletionOutput, RequestOutput
from graphrunner.sampling_params import SamplingParams
from graphrunner.server.responses import ChoiceStream, error_body, usage

Opened = list[tuple[AsyncIterator[RequestOutput], RequestOutput]]
DISCONNECT_POLL_S = 0.5


class ClientDisconnected(Exception):
    """The client went away before the (non-streaming) response was ready; its requests were aborted."""


async def open_streams(llm: AsyncLLM, prompts: list[Any], params: SamplingParams, base_id: str) -> Opened:
    """One generate() per prompt, each advanced to its first output so that a bad prompt (ValueError) or an
    overload (QueueFull) surfaces before any response starts; on failure the opened ones are closed (aborted)."""
    opened: Opened = []
    try:
        for i, prompt in enumerate(prompts):
            gen = llm.generate(prompt, params, f"{base_id}-{i}")
            try:
                first = await gen.__anext__()
            except BaseException:
                await gen.aclose()
                raise
            opened.append((gen, first))
    except BaseException:
        for gen, _ in opened:
            await gen.aclose()
        raise
    return opened


async def _finish(gen: AsyncIterator[RequestOutput], first: RequestOutput) -> RequestOutput:
    last = first
    async for out in gen:
        last = out
    return last


async def collect(opened: Opened, request: Request) -> list[RequestOutput]:
    """The final output of every stream; if the client disconnects meanwhile, abort them all."""
    task = asyncio.ensure_future(asyncio.gather(*(_finish(gen, first) for gen, first in opened)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected
    finally:
        if not task.done():
            task.cancel()  # the generators see CancelledError and abort their requests
            await asyncio.gather(task, return_exceptions=True)
        for gen, _ in opened:
            await gen.aclose()


async def merged(opened: Opened) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of every stream as they arrive, first outputs first."""
    for i, (_, first) in enumerate(opened):
        yield i, first
    pending = [i for i, (_, first) in enumerate(opened) if not first.finished]
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, opened[i][0])) for i in pending]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen, _ in opened:
            await gen.aclose()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


ChunkBuilder = Callable[[int, RequestOutput, CompletionOutput, tuple[str, int, int], ChoiceStream], dict[str, Any]]


async def stream_chunks(opened: Opened, n: int, hold: int, head: dict[str, Any], build: ChunkBuilder,
                        include_usage: bool, first_chunks: list[dict[str, Any]] | None = None) -> AsyncIterator[str]:
    """SSE lines: `first_chunks`, one chunk per new piece of each choice (built by `build`), the usage chunk if
    asked for, then `data: [DONE]`. An error mid-stream is sent as an error event before [DONE]."""
    states: dict[int, ChoiceStream] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        for chunk in first_chunks or []:
            yield sse({**head, **chunk})
        async for i, out in merged(opened):
            finals[i] = out
            for comp in out.outputs:
                index = i * n + comp.index
                state = states.setdefault(index, ChoiceStream(hold))
                piece = state.delta(comp)
                if piece is not None:
                    yield sse({**head, "choices": [build(index, out, comp, piece, state)]})
                    state.started = True
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(list(finals.values()))})
    except Exception as exc:  # noqa: BLE001 -- e.g. the engine stopped: tell the client, do not cut the stream
        yield sse(error_body(str(exc), type(exc).__name__, 500))
    yield "data: [DONE]\n\n"
