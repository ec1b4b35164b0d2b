"""The OpenAI-compatible HTTP API: request schemas, routes and errors in OpenAI's shape.

The ingress deployment checks each request against the schema (a 400 in OpenAI's error shape
otherwise), then streams events from the engine deployment and turns them into OpenAI responses
or SSE chunks.
"""

# No `from __future__ import annotations` here: FastAPI reads the route annotations at runtime.
import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServeConfig

# --- request schemas --------------------------------------------------------------------------


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Speculation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    budget: int | Literal["chain"] | None = Field(
        None, description="Tree budget for this request only: 0 = plain decoding, 'chain', or N."
    )


class _Sampling(BaseModel):
    """Fields every generation request shares. Unknown fields are ignored, as OpenAI's API does
    with fields a model does not use; wrong types and out-of-range values are 400s."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: Speculation | None = None

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
        }


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
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
    prompt: str | list[str]

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


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": code}},
    )


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


app = FastAPI(title="ddtree", description="OpenAI-compatible API of ddtree")


@app.exception_handler(RequestValidationError)
async def _invalid(request: Request, err: RequestValidationError):
    message, param = _validation_message(err)
    return error_response(400, message, param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException):
    return error_response(err.status_code, str(err.detail), code="not_found" if err.status_code == 404 else None)


@app.exception_handler(Exception)
async def _unexpected(request: Request, err: Exception):
    return error_response(500, f"internal error ({type(err).__name__}); the server keeps serving")


# --- the ingress deployment -------------------------------------------------------------------


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, config: dict, engine: DeploymentHandle):
        self.config = ServeConfig.model_validate(config)
        self.model = self.config.served_name
        self.engine = engine.options(stream=True)
        self.info = engine.model_info

    @app.get("/health")
    async def health(self) -> dict:
        await self.info.remote()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        info = await self.info.remote()
        return {"object": "list", "data": [
            {"id": info["id"], "object": "model", "created": info["created"], "owned_by": "ddtree",
             "max_model_len": info["context_length"]}
        ]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        return await self._respond(body, "chat")

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._respond(body, "completion")

    async def _respond(self, body: _Sampling, kind: str):
        if body.model != self.model:
            return error_response(
                404, f"the model '{body.model}' does not exist; this server serves '{self.model}'",
                "model", "model_not_found",
            )
        events = self.engine.stream.remote(body.engine_body())
        first = await events.__anext__()
        if first["type"] == "error":
            return error_response(first["status"], first["message"], first["param"])
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._sse(events, first, kind, ident, created, include_usage), media_type="text/event-stream"
            )
        text, end = [], None
        async for event in events:
            if event["type"] == "delta":
                text.append(event["text"])
            elif event["type"] == "end":
                end = event
        content = "".join(text)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None}
            if kind == "chat"
            else {"index": 0, "text": content, "logprobs": None}
        )
        choice["finish_reason"] = end["finish_reason"]
        return {
            "id": ident,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created,
            "model": self.model,
            "choices": [choice],
            "usage": end["usage"],
            "seed": first["seed"],
        }

    async def _sse(self, events, first, kind, ident, created, include_usage) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> dict:
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if role else ({"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            return {"id": ident, "object": obj, "created": created, "model": self.model,
                    "choices": [choice], "seed": first["seed"]}

        if kind == "chat":
            yield _sse(chunk(None, None, role=True))
        async for event in events:
            if event["type"] == "delta" and event["text"]:
                yield _sse(chunk(event["text"], None))
            elif event["type"] == "end":
                yield _sse(chunk(None, event["finish_reason"]))
                if include_usage:
                    yield _sse({"id": ident, "object": obj, "created": created, "model": self.model,
                                "choices": [], "usage": event["usage"]})
        yield "data: [DONE]\n\n"
