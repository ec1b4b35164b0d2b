"""The OpenAI-compatible HTTP API: request schemas, routes and errors in OpenAI's shape.

Before a request reaches a route, the `Guard` checks, in this order and without touching the
engine: the API key (401), the body size (413, refused before it is read whole), draining
(503), and admission (429 with Retry-After when the bounded number of generation requests is
in flight). The route then checks the request against the schema (strict types, encodable text,
unsupported OpenAI parameters) and the configured limits (a 400 in OpenAI's error shape
otherwise), streams events from the engine deployment and turns them into OpenAI responses or
SSE chunks. An engine replica that fails mid-request ends a stream with an error event and
`[DONE]`, and a whole response with a 503; nothing is retried.
"""

# No `from __future__ import annotations` here: FastAPI reads the route annotations at runtime.
import asyncio
import contextlib
import contextvars
import hmac
import json
import logging
import os
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Awaitable, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat import chat_completion, chat_completion_chunk
from openai.types.shared import ErrorObject
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, TaskCancelledError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import parse_budget
from .config import ServeConfig

logger = logging.getLogger("ray.serve")

HEALTH_TIMEOUT_S = 5.0  # /health waits this long for an engine replica before saying 503
# In its first this-long after the ingress starts, /health waits for the engine's first answer
# (an engine that is up answers in milliseconds); later, one still loading says "loading" at once.
HEALTH_FIRST_ANSWER_S = 1.0
HEALTH_STATUS_TIMEOUT_S = 2.0  # an unhealthy /health reads Serve's status for its reason at most this long
ENGINE_PING_RETRY_S = 0.5  # EngineReadiness asks again this long after a failed ask
# /health's 503s: status -> (error code, message)
UNHEALTHY = {
    "loading": ("engine_loading", "the engine is loading the model; retry shortly"),
    "unavailable": ("engine_unavailable", "no engine replica answers; retry shortly"),
    "draining": ("draining", "the server is shutting down; retry on another replica"),
}
ENGINE_DEPLOYMENT = "DDTreeEngine"

# --- request schemas --------------------------------------------------------------------------


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text cannot be encoded as UTF-8 (it holds a lone surrogate)") from None
    return text


# Text from the client: JSON may carry "\ud800", which decodes to a str no tokenizer (and no
# JSON response) can encode.
Text = Annotated[str, AfterValidator(_encodable)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class Speculation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    budget: Annotated[StrictInt, Field(ge=0)] | Literal["chain", "auto"] | None = Field(
        None, description="Tree budget for this request only: 0 = plain decoding, 'chain', N "
        "(at most the server's max_budget), or 'auto' (the server's budget policy)."
    )
    lookup: StrictBool | None = Field(
        None, description="Lookup branches in this request's trees (prompt lookup merged into the draft "
        "tree); None = the server's default."
    )
    topk: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="The most children a node of this request's trees may have, whatever its budget "
        "(budget 16 with topk 1: a chain padded to 17 verify rows); None = the server's default."
    )


# OpenAI parameters that would change what a request means, and the values that leave it
# unchanged; any other value is a 400 naming the parameter rather than being silently ignored.
UNSUPPORTED_PARAMETERS: dict[str, tuple] = {
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "logit_bias": ({},),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
}


def unsupported_parameter(extra: dict[str, Any]) -> str | None:
    """The first field of `extra` (a request's unknown fields) that would change its meaning."""
    for name, value in extra.items():
        neutral = UNSUPPORTED_PARAMETERS.get(name)
        if neutral is None or value is None:
            continue
        if not any(type(value) is type(v) and value == v for v in neutral):  # True is not 1
            return name
    return None


class _Sampling(BaseModel):
    """Fields every generation request shares. Types are strict (no `true` for an integer, no
    "yes" for a boolean); unknown fields are ignored, as OpenAI's API does with fields a model
    does not use, except those in UNSUPPORTED_PARAMETERS; out-of-range values are 400s."""

    model_config = ConfigDict(extra="allow")

    model: Text
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = None
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    speculation: Speculation | None = None
    return_token_ids: StrictBool = Field(
        False, description="As vLLM: the response also carries `prompt_token_ids` and its choice `token_ids` "
        "(the completion's tokens, EOS included), for comparing outputs token by token (`ddtree audit --url`). "
        "Non-streamed responses only."
    )

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return [s for s in stops if s]

    def engine_body(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop or [],
            "budget": self.speculation.budget if self.speculation else None,
            "lookup": self.speculation.lookup if self.speculation else None,
            "topk": self.speculation.topk if self.speculation else None,
            "return_token_ids": self.return_token_ids,
        }


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra chat-template variables for this request (as vLLM accepts them), merged "
        "over the server's, e.g. {\"enable_thinking\": true}."
    )

    def engine_body(self) -> dict:
        body = super().engine_body()
        body["max_tokens"] = self.max_completion_tokens or self.max_tokens
        return {**body, "kind": "chat", "messages": [m.as_template_dict() for m in self.messages],
                "chat_template_kwargs": self.chat_template_kwargs}


class CompletionRequest(_Sampling):
    prompt: Text | list[Text]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("send one prompt per request (a list of exactly one string)")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    def engine_body(self) -> dict:
        return {**super().engine_body(), "kind": "completion", "prompt": self.prompt}


# --- errors in OpenAI's shape -----------------------------------------------------------------


ERROR_TYPES = {429: "rate_limit_error"}  # else OpenAI's: invalid_request_error below 500


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}: OpenAI's error shape (the openai client
    raises it as the APIError of `status`)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    param = None if param is None else _encodable_text(param)
    error = ErrorObject(message=_encodable_text(message), type=kind, param=param, code=code)
    return {"error": error.model_dump(exclude_unset=True)}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param, code), headers=headers)


def _encodable_text(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (a lone surrogate in a field name the client
    sent, which a parameter path repeats) escaped, so the error itself can be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_event(status: int, message: str, code: str | None = None) -> str:
    """An SSE error event: OpenAI's error shape (the openai client raises it mid-stream)."""
    return sse_event(error_body(status, message, code=code))


def sse_event(payload: BaseModel | dict) -> str:
    """One server-sent event carrying `payload` as JSON. An openai type is written with only
    the fields set on it (OpenAI's wire shape: no null service_tier, system_fingerprint, ...),
    by json.dumps like a dict, so every event is formatted alike."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json", exclude_unset=True)
    return f"data: {json.dumps(payload)}\n\n"


def _body_path(body: Any, loc: list) -> list[str]:
    """The part of a pydantic error location that exists in the request body: drops the union
    member tags pydantic adds (`speculation.budget.int` -> `speculation.budget`)."""
    path, node = [], body
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            if not path and isinstance(part, str):  # a missing top-level field
                path.append(part)
            break
        path.append(str(part))
    return path


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = ".".join(_body_path(err.body, loc)) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def engine_failure(err: BaseException) -> tuple[int, str]:
    """An engine call that raised -> (status, message). The message names no exception class:
    a replica that stopped is a 503 the client may retry; a call cancelled because its client went
    away (Serve cancels a request's engine calls with it) is answered to nobody, a 499 unlogged;
    anything else is logged, and a 500."""
    if isinstance(err, (TaskCancelledError, asyncio.CancelledError)):
        return 499, "the client closed the request"
    if isinstance(err, (RayActorError, ActorUnavailableError, ReplicaUnavailableError, DeploymentUnavailableError)):
        return 503, "the engine replica serving this request stopped; retry the request"
    logger.error("ddtree: a request failed", exc_info=err)
    return 500, "internal error; the server keeps serving"


# --- the guard: checks before a request reaches a route ----------------------------------------

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")


class Guard:
    """What the ingress checks before a route sees a request: the API key, draining, admission
    and the body size. One per ingress replica; its counters live on the replica's event loop."""

    def __init__(self, config: ServeConfig):
        keys = [k.get_secret_value() for k in config.api_key]
        keys += [k.strip() for k in os.environ.get("DDTREE_API_KEY", "").split(",") if k.strip()]
        self.keys = [k.encode() for k in keys]
        self.max_body = config.max_request_bytes
        self.max_inflight = config.max_inflight_requests
        self.retry_after = {"Retry-After": str(config.retry_after_s)}
        self.inflight = 0
        self.draining = False

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        if not self.keys:
            return True
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        matched = False
        for key in self.keys:  # every key, constant time each: no early exit to time
            matched |= hmac.compare_digest(token.strip(), key)
        return scheme.lower() == b"bearer" and matched


class GuardMiddleware:
    """ASGI middleware running the ingress replica's Guard (found through the replica context:
    Serve copies the FastAPI app when the class is decorated, so the app cannot hold it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        guard: Guard = serve.get_replica_context().servable_object.guard
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not guard.authorized(headers):
            refusal = error_response(
                401, "a valid API key is required: send `Authorization: Bearer <key>`",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )
            return await refusal(scope, receive, send)
        body = await self._read_body(scope, receive, guard.max_body)
        if body is None:
            refusal = error_response(413, f"the request body exceeds {guard.max_body} bytes",
                                     code="request_too_large")
            return await refusal(scope, receive, send)
        # Admission counts requests whose body has arrived: a client sending slowly holds no place.
        generation = path in GENERATION_ROUTES
        if generation and guard.draining:
            refusal = error_response(503, "the server is shutting down; retry on another replica",
                                     code="draining", headers=guard.retry_after)
            return await refusal(scope, receive, send)
        if generation and guard.inflight >= guard.max_inflight:
            refusal = error_response(
                429, f"the server is at capacity ({guard.max_inflight} requests in flight); retry "
                f"after {guard.retry_after['Retry-After']} s", code="server_busy", headers=guard.retry_after,
            )
            return await refusal(scope, receive, send)
        guard.inflight += generation
        try:
            replayed = False

            async def replay():
                nonlocal replayed
                if replayed:  # after the body: the disconnect, when it comes
                    try:
                        return await receive()
                    except TaskCancelledError:  # Serve's word that the client went away
                        return {"type": "http.disconnect"}
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await self.app(scope, replay, send)
        finally:
            guard.inflight -= generation

    @staticmethod
    async def _read_body(scope, receive, limit: int) -> bytes | None:
        """The whole body, or None as soon as it is known to exceed `limit` bytes (from its
        Content-Length, or while it arrives): the rest is never read."""
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)


app = FastAPI(title="ddtree", description="OpenAI-compatible API of ddtree")
app.add_middleware(GuardMiddleware)


@app.exception_handler(RequestValidationError)
async def _invalid(request: Request, err: RequestValidationError):
    message, param = _validation_message(err)
    return error_response(400, message, param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException):
    return error_response(err.status_code, str(err.detail), code="not_found" if err.status_code == 404 else None)


@app.exception_handler(Exception)
async def _unexpected(request: Request, err: Exception):
    status, message = engine_failure(err)
    return error_response(status, message)


# --- the ingress deployment -------------------------------------------------------------------


class EngineReadiness:
    """Whether an engine replica has answered this ingress yet, learned outside any request.

    Serve starts the ingress without waiting for the engine deployment's constructor (minutes
    for a large model), and a call to the engine waits until a replica runs. So one task of the
    ingress's own asks the engine until it answers once; /health only waits on what that task
    learns. The task runs in an empty context: Serve links a call made inside a request to that
    request and cancels it when the client gives up, and a probe's cancellation must never
    decide what later probes see (it once turned every later /health into a 500)."""

    def __init__(self, ask: Callable[[], Awaitable[Any]]):
        self.ask = ask
        self.event = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.started = 0.0  # the event loop's time when the asking began
        with contextlib.suppress(RuntimeError):  # a constructor run on the replica's event loop
            self.start()

    def start(self) -> None:
        if self.task is None:
            loop = asyncio.get_running_loop()
            self.started = loop.time()
            self.task = loop.create_task(self._until_answered(), context=contextvars.Context())

    async def _until_answered(self) -> None:
        while True:
            try:
                await self.ask()
            except Exception:  # e.g. the replica died before answering: ask again
                logger.info("ddtree: the engine did not answer yet; asking again", exc_info=True)
                await asyncio.sleep(ENGINE_PING_RETRY_S)
                continue
            self.event.set()
            return

    async def answered(self, wait_s: float) -> bool:
        """True once an engine replica has answered. In the first `wait_s` of asking (an engine
        that is up answers in milliseconds) it waits for that; later it says at once."""
        self.start()
        left = self.started + wait_s - asyncio.get_running_loop().time()
        if not self.event.is_set() and left > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.event.wait(), left)
        return self.event.is_set()


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, config: dict, engine: DeploymentHandle):
        self.config = ServeConfig.model_validate(config)
        self.model = self.config.served_name
        # Each token a step emits is one stream item from the engine replica. By value over Serve's
        # inter-deployment gRPC, not as an object in Ray's store: a stream item costs both
        # replicas less CPU, which on a small node the engine's steps feel (docs/deployment.md).
        self.engine = engine.options(stream=True, _by_reference=False)
        self.info = engine.model_info
        self.guard = Guard(self.config)
        self.readiness = EngineReadiness(self._ping)

    @app.get("/health")
    async def health(self):
        """200 {"status": "ok", "details": {"kernels": {"linear", "attention", "bitwise", "reason"},
        "cuda_graphs": {"captured", "capture_seconds", "memory_bytes", "left_out", "eager_steps"} | null}}
        when an engine replica answers: which backends run the target's linears and attention on
        the replica that answered (engine.check_kernels; docs/cpu-kernels.md), and the verify
        forwards it captured as CUDA graphs (null: none; docs/gpu.md). Otherwise 503 with Retry-After and
        OpenAI's error shape beside a "status": "draining" (after SIGTERM), "loading" (no engine
        replica has answered this ingress yet: said at once while the first one builds the model;
        later, while one restarts) or "unavailable". Every answer comes within
        HEALTH_FIRST_ANSWER_S + HEALTH_TIMEOUT_S + HEALTH_STATUS_TIMEOUT_S, and a probe that gives
        up early changes nothing: it asks the engine only for itself."""
        if self.guard.draining:
            return self._unhealthy("draining")
        if not await self.readiness.answered(HEALTH_FIRST_ANSWER_S):
            return self._unhealthy("loading")
        try:
            info = await asyncio.wait_for(self._ping(), HEALTH_TIMEOUT_S)
        except Exception:
            return self._unhealthy(await self._engine_state())
        return {"status": "ok", "details": {"kernels": info["kernels"], "cuda_graphs": info.get("cuda_graphs")}}

    def _unhealthy(self, state: str) -> JSONResponse:
        code, message = UNHEALTHY[state]
        body = {"status": state, **error_body(503, message, code=code)}
        return JSONResponse(body, 503, self.guard.retry_after)

    async def _ping(self) -> dict:
        return await self.info.remote()

    async def _engine_state(self) -> str:
        """"loading" while the engine deployment has no running replica, else "unavailable"
        (also when Serve's controller does not say within HEALTH_STATUS_TIMEOUT_S)."""
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), HEALTH_STATUS_TIMEOUT_S)
            app_name = serve.get_replica_context().app_name
            states = status.applications[app_name].deployments[ENGINE_DEPLOYMENT].replica_states
            running = sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")
        except Exception:
            logger.exception("ddtree: could not read the engine deployment's state")
            return "unavailable"
        return "unavailable" if running else "loading"

    async def drain(self) -> int:
        """Stop admitting generation requests (503 from now on; /health says "draining") and
        return how many are still in flight. `ddtree serve` calls it on SIGTERM."""
        self.guard.draining = True
        return self.guard.inflight

    async def in_flight(self) -> int:
        return self.guard.inflight

    @app.get("/v1/models")
    async def models(self) -> dict:
        info = await self.info.remote()
        model = Model(id=info["id"], object="model", created=info["created"], owned_by="ddtree",
                      max_model_len=info["context_length"])
        return {"object": "list", "data": [model.model_dump(exclude_unset=True)]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        return await self._respond(body, "chat")

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._respond(body, "completion")

    def _refusal(self, body: _Sampling, kind: str) -> JSONResponse | None:
        """A 4xx for a request the configured limits refuse, before any engine work."""
        if body.model != self.model:
            return error_response(
                404, f"the model '{body.model}' does not exist; this server serves '{self.model}'",
                "model", "model_not_found",
            )
        name = unsupported_parameter(body.model_extra or {})
        if name is not None:
            return error_response(
                400, f"{name}: not supported by this server (send it unset or at its default)",
                name, "unsupported_parameter",
            )
        config = self.config
        if kind == "chat" and len(body.messages) > config.max_messages:
            return error_response(
                400, f"messages: {len(body.messages)} messages; this server takes at most {config.max_messages}",
                "messages",
            )
        for field in ("max_tokens", "max_completion_tokens"):
            value = getattr(body, field, None)
            if value is not None and value > config.max_output_tokens:
                return error_response(
                    400, f"{field}: {value} exceeds this server's limit of {config.max_output_tokens}", field
                )
        if body.return_token_ids and body.stream:
            return error_response(400, "return_token_ids: only a non-streamed response carries token ids",
                                  "return_token_ids")
        budget = body.speculation.budget if body.speculation else None
        if budget is not None:
            try:
                parse_budget(budget, config.max_budget)  # the engine checks it again by the same rule
            except ValueError as err:
                return error_response(400, f"speculation.budget: {err}", "speculation.budget")
        return None

    def _engine_error(self, event: dict) -> JSONResponse:
        """An error event of the engine: a 429 (its queue is full) or 503 says when to retry."""
        status = event["status"]
        headers = self.guard.retry_after if status in (429, 503) else None
        return error_response(status, event["message"], event.get("param"), headers=headers)

    def _failure(self, err: BaseException) -> JSONResponse:
        status, message = engine_failure(err)
        return error_response(status, message, headers=self.guard.retry_after if status == 503 else None)

    async def _respond(self, body: _Sampling, kind: str):
        refusal = self._refusal(body, kind)
        if refusal is not None:
            return refusal
        events = self.engine.stream.remote(body.engine_body())
        try:
            first = await events.__anext__()
        except Exception as err:
            return self._failure(err)
        if first["type"] == "error":
            return self._engine_error(first)
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._stream_chunks(events, first, kind, ident, created, include_usage), media_type="text/event-stream"
            )
        text, tokens, end = [], [], None
        try:
            async for event in events:
                if event["type"] == "delta":
                    text.append(event["text"])
                    tokens += event["tokens"]
                elif event["type"] == "end":
                    end = event
                elif event["type"] == "error":
                    return self._engine_error(event)
        except Exception as err:
            return self._failure(err)
        if end is None:
            return error_response(500, "internal error: the engine ended the request unfinished")
        ids = {"prompt_token_ids": first["prompt_token_ids"], "token_ids": tokens} if body.return_token_ids else {}
        return self._whole_response(kind, ident, created, "".join(text), end, first["seed"], **ids)

    def _whole_response(self, kind: str, ident: str, created: int, content: str, end: dict, seed,
                        **token_ids: list[int]) -> dict:
        """The non-streamed response: OpenAI's ChatCompletion or Completion, plus ddtree's `seed`
        (the seed of the draws, to send back for the same text) and `usage.speculation`; with
        `token_ids` (return_token_ids), vLLM's `prompt_token_ids` and the choice's `token_ids`."""
        usage = CompletionUsage.model_validate(end["usage"])
        on_choice = {"token_ids": token_ids["token_ids"]} if token_ids else {}
        on_reply = {"prompt_token_ids": token_ids["prompt_token_ids"]} if token_ids else {}
        if kind == "chat":
            message = ChatCompletionMessage(role="assistant", content=content)
            choice = chat_completion.Choice(index=0, message=message, logprobs=None, finish_reason=end["finish_reason"],
                                            **on_choice)
            reply = ChatCompletion(id=ident, object="chat.completion", created=created, model=self.model,
                                   choices=[choice], usage=usage, seed=seed, **on_reply)
        else:
            choice = CompletionChoice(index=0, text=content, logprobs=None, finish_reason=end["finish_reason"],
                                      **on_choice)
            reply = Completion(id=ident, object="text_completion", created=created, model=self.model,
                               choices=[choice], usage=usage, seed=seed, **on_reply)
        return reply.model_dump(mode="json", exclude_unset=True)

    async def _stream_chunks(self, events, first, kind, ident, created, include_usage) -> AsyncIterator[str]:
        """The engine's events as OpenAI's SSE stream: chunks (each with ddtree's `seed`), the usage
        chunk when asked for, an error event if the engine fails, and always `[DONE]` last."""

        def chunk(delta_text: str | None, finish: str | None, role: bool = False):
            if kind == "chat":
                delta = chat_completion_chunk.ChoiceDelta(role="assistant", content="") if role else (
                    chat_completion_chunk.ChoiceDelta(content=delta_text) if delta_text
                    else chat_completion_chunk.ChoiceDelta())
                choice = chat_completion_chunk.Choice(index=0, delta=delta, logprobs=None, finish_reason=finish)
                return ChatCompletionChunk(id=ident, object="chat.completion.chunk", created=created,
                                           model=self.model, choices=[choice], seed=first["seed"])
            # OpenAI streams a completion as Completion objects whose finish_reason is null until
            # the last one; the generated type requires it, so these are built unvalidated, as the
            # openai client builds them when it reads the stream.
            choice = CompletionChoice.model_construct(index=0, text=delta_text or "", logprobs=None,
                                                      finish_reason=finish)
            return Completion.model_construct(id=ident, object="text_completion", created=created,
                                              model=self.model, choices=[choice], seed=first["seed"])

        def usage_chunk(usage: dict):
            fields = dict(id=ident, created=created, model=self.model, choices=[],
                          usage=CompletionUsage.model_validate(usage))
            if kind == "chat":
                return ChatCompletionChunk(object="chat.completion.chunk", **fields)
            return Completion(object="text_completion", **fields)

        if kind == "chat":
            yield sse_event(chunk(None, None, role=True))
        ended = False
        try:
            async for event in events:
                if event["type"] == "delta" and event["text"]:
                    yield sse_event(chunk(event["text"], None))
                elif event["type"] == "end":
                    ended = True
                    yield sse_event(chunk(None, event["finish_reason"]))
                    if include_usage:
                        yield sse_event(usage_chunk(event["usage"]))
                elif event["type"] == "error":
                    ended = True
                    yield error_event(event["status"], event["message"])
        except Exception as err:  # the engine replica died mid-stream: say so, never cut the stream
            ended = True
            yield error_event(*engine_failure(err))
        if not ended:
            yield error_event(500, "internal error: the engine ended the request unfinished")
        yield "data: [DONE]\n\n"
