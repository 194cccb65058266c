"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions.

Request and response fields follow the OpenAI API; the official `openai` client works
unchanged. Extensions (the way vLLM extends the body), passed with the client's
`extra_body`:

    session       ask on this session: the context is already in its cache, so the
                  question costs O(|question|); without one the request is stateless:
                  a temporary session (the system message as its system prompt) is
                  opened, asked and closed
    question_id   a standing question of the session: the fast or entry path
    min_version   wait until the session has ingested this data_version

Every response (and the last chunk of a stream) carries `streamllm`: session, path
(fast / entry / cold), confidence, data_version, tokens_computed, latency_ms, stale.
Decoding is greedy: temperature, top_p and seed are accepted and ignored. In chat, the
question is the last user message; earlier turns are not replayed (a session's context
is its data). `usage.prompt_tokens` counts prompt tokens computed for this answer (0 on
the fast and entry paths: that prefill was pre-paid).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from streamllm.config import limits
from streamllm.engine.prompt import DEFAULT_SYSTEM
from streamllm.service import protocol as p
from streamllm.service.connection import (
    bridge,
    is_standing,
    submit_off_loop,
    threadsafe,
    until_disconnect,
)
from streamllm.service.httpauth import (
    ApiError,
    JsonResponse,
    from_engine,
    hold_connection,
    json_body,
    session_name,
    tenant_of,
)
from streamllm.service.quotas import QuotaExceeded
from streamllm.service.sse import sse, sse_response
from streamllm.service.tenants import Tenant

if TYPE_CHECKING:
    from streamllm.service.server import StreamServer

_temp_ids = itertools.count(1)


class Ask:
    """One validated completion request."""

    __slots__ = ("chat", "model", "question", "question_param", "system", "max_tokens", "stop", "stream", "session", "question_id",
                 "min_version", "include_usage")

    def __init__(self, body: dict[str, Any], chat: bool, model_name: str) -> None:
        self.chat = chat
        self.model = _field(body, "model", str, "a model id (GET /v1/models)")
        if self.model != model_name:
            raise ApiError(404, f"the model {self.model!r} does not exist; this server serves {model_name!r}",
                           code="model_not_found", param="model")
        self.system: str | None = None
        self.question_param = "prompt"
        if chat:
            self.question = self._from_messages(_field(body, "messages", list, "an array of messages"))
        else:
            prompt = _field(body, "prompt", (str, list), "a string")
            if isinstance(prompt, list):
                if len(prompt) != 1 or not isinstance(prompt[0], str):
                    raise ApiError(400, "prompt: one string per request (batches of prompts are not supported)",
                                   code=p.BAD_FIELD, param="prompt")
                prompt = prompt[0]
            self.question = prompt
        _within(self.question_param, limits.text_problem(self.question))
        tokens_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        self.max_tokens = _field(body, tokens_key, (int, type(None)), f"an integer in [1, {p.MAX_ASK_TOKENS}]", None)
        if self.max_tokens is not None:
            if self.max_tokens < 1:
                raise ApiError(400, f"{tokens_key!r} must be at least 1, got {self.max_tokens}", code=p.BAD_FIELD,
                               param=tokens_key)
            _within(tokens_key, limits.max_tokens_problem(self.max_tokens))
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
            raise ApiError(400, f"stop must be a non-empty string or an array of up to {p.MAX_STOPS} of them",
                           code=p.BAD_FIELD, param="stop")
        if stop is not None:
            _within("stop", limits.stops_problem(stop))
        self.stop = stop
        self.stream = _field(body, "stream", bool, "true or false", False)
        options = _field(body, "stream_options", (dict, type(None)), "an object", None) or {}
        self.include_usage = bool(options.get("include_usage"))
        n = _field(body, "n", (int, type(None)), "1", None)
        if n not in (None, 1):
            raise ApiError(400, "n: only one choice per request", code=p.BAD_FIELD, param="n")
        for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            _field(body, key, (int, float, type(None)), "a number", None)
        session = _field(body, "session", (str, type(None)), "a session name", None)
        self.session = None if session is None else session_name(session)
        self.question_id = _field(body, "question_id", (str, type(None)), "a standing question id", None)
        if self.question_id is not None and self.session is None:
            raise ApiError(400, "question_id needs a session: standing questions live on sessions",
                           code=p.BAD_FIELD, param="question_id")
        self.min_version = _int(body, "min_version", 0, 1 << 62)
        if self.question_id is None and not self.question.strip():
            raise ApiError(400, "the question is empty", code=p.BAD_FIELD, param="messages" if chat else "prompt")

    def _from_messages(self, messages: list[Any]) -> str:
        question = None
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a 'role'", code=p.BAD_FIELD,
                               param=f"messages[{i}]")
            text = _content(message.get("content"), i)
            if message["role"] in ("system", "developer"):
                self.system = text if self.system is None else f"{self.system}\n{text}"
            elif message["role"] == "user":
                question, self.question_param = text, f"messages[{i}].content"
        if question is None:
            raise ApiError(400, "messages: needs a user message (the question)", code=p.BAD_FIELD, param="messages")
        return question


def routes(server: StreamServer) -> list[Route]:
    api = OpenAIApi(server)
    return [Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"])]


class OpenAIApi:
    def __init__(self, server: StreamServer) -> None:
        self.server = server
        self.engine = server.engine
        self.created = int(time.time())

    async def models(self, request: Request) -> Response:
        tenant_of(self.server, request)
        return JsonResponse({"object": "list", "data": [
            {"id": self.engine.model_name, "object": "model", "created": self.created, "owned_by": "streamllm"}]})

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, chat: bool) -> Response:
        server = self.server
        kind = "chat.completions" if chat else "completions"
        tenant = tenant_of(server, request)
        ask = Ask(await json_body(request, server.config.max_message_bytes), chat, self.engine.model_name)
        server.metrics.messages.labels("chat" if chat else "completion").inc()
        if ask.session is None and tenant.read_only:
            tenant_of(server, request, write=True)  # 403: a stateless request opens a session
        t0 = time.perf_counter()
        release = self._hold(tenant, kind)
        try:
            temp = await self._open_temp(tenant, ask) if ask.session is None else None
        except BaseException:
            release()
            raise
        name = temp or tenant.engine_name(ask.session)  # type: ignore[arg-type]
        try:
            if ask.question_id is not None:
                known = {q.id for q in await asyncio.to_thread(self.engine.standing_questions, name)}
                if ask.question_id not in known:
                    raise ApiError(404, f"session {ask.session!r} has no standing question {ask.question_id!r}",
                                   code=p.UNKNOWN_QUESTION, param="question_id")
            queue: asyncio.Queue[str | None] | None = asyncio.Queue() if ask.stream else None
            kw: dict[str, Any] = {"stop": ask.stop, "min_version": ask.min_version}
            if ask.max_tokens is not None:
                kw["max_tokens"] = ask.max_tokens
            if queue is not None:
                kw["on_text"] = threadsafe(asyncio.get_running_loop(), queue.put_nowait)
            question = ask.question_id or ask.question
            if ask.question_id is not None or is_standing(self.engine, name, question):  # nothing to tokenize
                future = self.engine.submit_ask(name, question, **kw)
            else:  # a cold question is tokenized by submit_ask: in a worker thread, never on the loop
                future = await submit_off_loop(lambda: self.engine.submit_ask(name, question, **kw))
        except BaseException as exc:
            release()
            await self._close_temp(temp)
            if isinstance(exc, Exception) and not isinstance(exc, ApiError):
                raise from_engine(exc, kind) from None
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if queue is None:
            try:
                answer = await _answer_unless_gone(request, future)
            except Exception as exc:
                raise from_engine(exc, kind) from None
            finally:
                release()
                await self._close_temp(temp)
            if answer is None:  # the client went away: its question was cancelled, nobody reads this
                return Response(status_code=499)
            self._count(answer, t0)
            return JsonResponse(self._whole(ask, rid, answer))

        closed = temp is None

        async def end() -> None:
            """From the stream's `finally`, and again from the response's background task (the client may
            have left before the stream began, or while it ran, cancelling the close of its session)."""
            nonlocal closed
            future.cancel()  # the client is gone before the answer: so is the question (a no-op once answered)
            release()
            if not closed:
                await self._close_temp(temp)
                closed = True

        return sse_response(self._chunks(ask, rid, future, queue, t0, end), on_close=end)

    def _hold(self, tenant: Tenant, kind: str) -> Callable[[], None]:
        """Hold one of the tenant's connections and one of its questions in flight until the release
        (safe to call twice); 429 `quota` or 503 `capacity` when over a limit."""
        release_connection = hold_connection(self.server, tenant)
        quotas = self.server.quotas
        try:
            quotas.take_ask(tenant.name)
        except QuotaExceeded as exc:
            release_connection()
            self.server.metrics.errors.labels(p.QUOTA).inc()
            raise from_engine(exc, kind) from None
        held = True

        def release() -> None:
            nonlocal held
            release_connection()
            if held:
                held = False
                quotas.release_ask(tenant.name)

        return release

    async def _open_temp(self, tenant: Tenant, ask: Ask) -> str:
        # '.' cannot start a client's session name: temporary sessions never collide with real ones.
        name = tenant.engine_name(f".stateless-{next(_temp_ids)}")
        system = ask.system if ask.system is not None else DEFAULT_SYSTEM
        try:  # reserve what the prompt needs, not a full session's budget
            max_context = await asyncio.to_thread(self.engine.prefix_tokens, system) + 64
            await asyncio.to_thread(self.engine.open_session, name, system, max_context=max_context,
                                    tenant=tenant.name)
        except Exception as exc:
            raise from_engine(exc, "completions") from None
        return name

    async def _close_temp(self, name: str | None) -> None:
        if name is not None:
            with contextlib.suppress(KeyError):  # closed already
                await asyncio.to_thread(self.engine.close_session, name)

    def _count(self, answer: Any, t0: float) -> None:
        self.server.metrics.answers.labels(answer.path).inc()
        self.server.metrics.ask_seconds.labels(answer.path).observe(time.perf_counter() - t0)

    def _extension(self, ask: Ask, answer: Any) -> dict[str, Any]:
        return {"session": ask.session, "question_id": ask.question_id, "path": answer.path,
                "confidence": answer.confidence, "data_version": answer.data_version,
                "tokens_computed": answer.tokens_computed, "latency_ms": answer.latency_ms, "stale": answer.stale}

    def _usage(self, answer: Any) -> dict[str, int]:
        completion = len(answer.tokens)
        prompt = max(0, answer.tokens_computed - completion)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _whole(self, ask: Ask, rid: str, answer: Any) -> dict[str, Any]:
        if ask.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": answer.text, "refusal": None},
                      "logprobs": None, "finish_reason": answer.finish_reason}
        else:
            choice = {"index": 0, "text": answer.text, "logprobs": None, "finish_reason": answer.finish_reason}
        return {"id": rid, "object": "chat.completion" if ask.chat else "text_completion", "created": int(time.time()),
                "model": ask.model, "choices": [choice], "usage": self._usage(answer),
                "streamllm": self._extension(ask, answer)}

    def _chunk(self, ask: Ask, rid: str, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if ask.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk" if ask.chat else "text_completion",
                "created": int(time.time()), "model": ask.model, "choices": [choice]}

    async def _chunks(self, ask: Ask, rid: str, future: Any, queue: asyncio.Queue, t0: float,
                      end: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
        done = bridge(future)
        done.add_done_callback(lambda _f: queue.put_nowait(None))  # after every token already queued
        streamed = False
        try:
            if ask.chat:
                yield sse(self._chunk(ask, rid, "", None, first=True))
            while (text := await queue.get()) is not None:
                streamed = True
                yield sse(self._chunk(ask, rid, text, None))
            await end()  # the temporary session closed before [DONE]: the client never sees it linger
            try:
                answer = done.result()
            except Exception as exc:
                yield sse(from_engine(exc, "completions").body())
                yield sse("[DONE]")
                return
            self._count(answer, t0)
            if not streamed and answer.text:  # fast path: the whole answer is one chunk
                yield sse(self._chunk(ask, rid, answer.text, None))
            last = self._chunk(ask, rid, None, answer.finish_reason)
            last["streamllm"] = self._extension(ask, answer)
            yield sse(last)
            if ask.include_usage:
                usage = self._chunk(ask, rid, None, None)
                usage["choices"], usage["usage"] = [], self._usage(answer)
                yield sse(usage)
            yield sse("[DONE]")
        finally:
            if not done.done():
                done.cancel()
            await end()


async def _answer_unless_gone(request: Request, future: Any) -> Any:
    """The engine's answer, or None when the client goes away first: its question is then cancelled (so
    is it when this handler is, the server stopping), freeing what it held in the engine."""
    answer = bridge(future)
    gone = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            future.cancel()
            answer.cancel()
    return None if answer.cancelled() else answer.result()


def _field(body: dict[str, Any], key: str, kinds: type | tuple[type, ...], what: str, default: Any = ...) -> Any:
    if key not in body:
        if default is ...:
            raise ApiError(400, f"missing required parameter {key!r} ({what})", code=p.BAD_FIELD, param=key)
        return default
    value = body[key]
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ApiError(400, f"{key!r} must be {what}, got {type(value).__name__}", code=p.BAD_FIELD, param=key)
    return value


def _within(param: str, problem: str | None) -> None:
    """400 `too_large` naming the parameter, when `problem` (a config/limits.py check) says it is over a limit."""
    if problem is not None:
        raise ApiError(400, f"{param}: {problem}", code=p.TOO_LARGE, param=param)


def _int(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = _field(body, key, (int, type(None)), f"an integer in [{low}, {high}]", None)
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"{key!r} must be in [{low}, {high}], got {value}", code=p.BAD_FIELD, param=key)
    return value


def _content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = [part.get("text") for part in content if part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)  # type: ignore[arg-type]
    raise ApiError(400, f"messages[{index}].content must be a string or an array of text parts",
                   code=p.BAD_FIELD, param=f"messages[{index}].content")
