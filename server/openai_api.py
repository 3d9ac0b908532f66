"""The OpenAI-compatible API without I/O: a request body -> an Engine API request (`chat_call`,
`completion_call`), engine events -> OpenAI's response body or SSE chunks (`ChatReply`, `CompletionReply`),
and OpenAI's error shape. server/http_api.py moves the bytes.

Chat completions (`POST /v1/chat/completions`): `messages`, `tools`, `tool_choice` (auto, none, required, a
named function), `response_format`, `reasoning_effort` and the thinking switch (`thinking`: true/false or
{"type": "enabled" | "disabled"}; `chat_template_kwargs.thinking` / `.enable_thinking`, as vLLM and SGLang
accept it) go to the engine, which encodes them in the checkpoint's dialect. Streamed deltas carry
`reasoning_content`, `content` and whole tool calls (one delta per call: `index`, `id`, `function.name` and
all of `function.arguments`; each call is validated before it is sent). `max_completion_tokens` (or
`max_tokens`; absent: up to the context limit), `stop`, `temperature`, `top_p`, `top_k` (-1 or 0: off),
`seed`, `ignore_eos`, `stream`, `stream_options.include_usage`. Usage has
`prompt_tokens_details.cached_tokens`: the prompt tokens reused from the previous request's state.

Refused with a 400 naming the parameter: `n` other than 1 (one user, one answer), `logprobs` /
`top_logprobs` (the captured decode cycle copies back token ids only; log-probabilities would need a second
copy and a host read per cycle, which this engine does not do), non-zero penalties and a `logit_bias`.
Unknown fields are ignored.
"""

import secrets
import time
from dataclasses import dataclass

from appliance.api import TEMPERATURE, TOP_K, TOP_P, ChatRequest, Done, Error, Request, Sampling, Started, Tokens
from appliance.errors import RequestError, shown

from . import fields

# Error code -> OpenAI error type.
ERROR_TYPES = {"invalid_request": "invalid_request_error", "context_length_exceeded": "invalid_request_error",
               "unauthorized": "authentication_error", "forbidden": "permission_error",
               "not_found": "invalid_request_error", "method_not_allowed": "invalid_request_error",
               "timeout": "invalid_request_error", "too_large": "invalid_request_error",
               "unsupported_media_type": "invalid_request_error", "busy": "rate_limit_error",
               "not_ready": "service_unavailable", "internal": "server_error", "cancelled": "server_error"}


def error_body(code: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(code, "server_error"), "param": param,
                      "code": code}}


@dataclass
class ApiRequest:
    """What one API body asks for."""

    request: Request
    stream: bool
    include_usage: bool


def _common(body: dict, max_tokens: int | None) -> dict:
    """The Request fields chat and completions share."""
    fields.integer(body, "n", 1, 1, " (one user per box: one answer per request)")
    fields.unsupported(body, "logprobs", (False, 0), "log-probabilities are not computed by this engine (its "
                       "captured decode cycle returns token ids only)")
    fields.unsupported(body, "top_logprobs", (0,), "log-probabilities are not computed by this engine")
    for name in ("presence_penalty", "frequency_penalty"):
        fields.unsupported(body, name, (0, 0.0), "penalties are not applied by this engine's sampler")
    if body.get("logit_bias"):
        raise RequestError("logit_bias: not supported by this engine's sampler", field="logit_bias")
    top_k = fields.integer(body, "top_k", -1, TOP_K[1], " (-1 or 0: off)")
    sampling = Sampling(temperature=fields.number(body, "temperature", *TEMPERATURE),
                        top_p=fields.number(body, "top_p", *TOP_P, low_open=True),
                        top_k=max(0, top_k or 0), seed=fields.seed(body))
    return dict(max_tokens=max_tokens, sampling=sampling, stop=fields.stop_list(body, "stop"),
                ignore_eos=fields.boolean(body, "ignore_eos"))


def _stream(body: dict) -> tuple[bool, bool]:
    stream = fields.boolean(body, "stream")
    options = fields.obj(body, "stream_options")
    return stream, stream and fields.boolean(options, "include_usage")


def checked(req: Request) -> Request:
    """The Request's own checks, with the parameter named as the API names it."""
    try:
        req.validate()
    except RequestError as e:
        field = e.field[len("sampling."):] if e.field and e.field.startswith("sampling.") else e.field
        raise RequestError(e.message, field=field, value=e.value, code=e.code) from None
    return req


def chat_call(body) -> ApiRequest:
    body = fields.body_object(body)
    if body.get("messages") is None:
        raise RequestError("messages: required (a list of {role, content})", field="messages")
    max_tokens = fields.integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = fields.integer(body, "max_tokens", 1)
    stream, usage = _stream(body)
    req = Request(id="chatcmpl-" + secrets.token_hex(12), chat=ChatRequest.from_body(body), **_common(body, max_tokens))
    return ApiRequest(checked(req), stream, usage)


def completion_call(body) -> ApiRequest:
    """`prompt`: text, or token ids (a list of integers); a batch of one is taken too."""
    body = fields.body_object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and (not prompt or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in prompt)):
        raise RequestError("prompt: must be text or a non-empty list of token ids (one prompt per request)",
                           field="prompt")
    if not isinstance(prompt, str | list):
        raise RequestError(f"prompt={shown(prompt)}: required: text or a list of token ids", field="prompt")
    fields.unsupported(body, "echo", (False,), "the prompt is not echoed back")
    fields.unsupported(body, "suffix", ("",), "no fill-in-the-middle")
    fields.integer(body, "best_of", 1, 1, " (one answer per request)")
    stream, usage = _stream(body)
    # OpenAI's default for completions is 16 tokens.
    max_tokens = fields.integer(body, "max_tokens", 1)
    req = Request(id="cmpl-" + secrets.token_hex(12), **({"prompt": prompt} if isinstance(prompt, str)
                                                          else {"input_ids": prompt}),
                  **_common(body, 16 if max_tokens is None else max_tokens))
    return ApiRequest(checked(req), stream, usage)


def model_body(model: str, max_context: int, created: int) -> dict:
    """The one model this box serves (`GET /v1/models/{id}`)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "decode-appliance",
            "max_model_len": max_context}


def models_body(model: str, max_context: int, created: int) -> dict:
    return {"object": "list", "data": [model_body(model, max_context, created)]}


def usage(done: Done) -> dict:
    u = done.usage
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)}}


def finish_reason(done: Done, made_calls: bool) -> str:
    if done.finish_reason == "stop" and made_calls:
        return "tool_calls"
    return done.finish_reason


class _Reply:
    """Events of one request -> chunks (streaming) and the whole body (not). `stream_*` return the chunks
    to send; every event must also be given to them when not streaming (they keep the totals)."""

    object = ""

    def __init__(self, call: ApiRequest, model: str):
        self.call = call
        self.id = call.request.id
        self.model = model
        self.created = int(time.time())
        self.finish: str | None = None
        self.usage: dict | None = None

    def _chunk(self, choice: dict | None, usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": self.object + ".chunk" if self.object == "chat.completion" else self.object,
                 "created": self.created, "model": self.model, "choices": [] if choice is None else [choice]}
        if self.call.include_usage:
            chunk["usage"] = usage
        return chunk

    def done(self, ev: Done) -> list[dict]:
        self.usage = usage(ev)
        self.finish = self._finish(ev)
        out = [self._chunk(self._final_choice())]
        if self.call.include_usage:
            out.append(self._chunk(None, self.usage))
        return out

    def _finish(self, ev: Done) -> str:
        return ev.finish_reason

    def _final_choice(self) -> dict:
        raise NotImplementedError

    def stream_error(self, ev: Error) -> dict:
        return stream_error(ev)


class ChatReply(_Reply):
    object = "chat.completion"

    def __init__(self, call: ApiRequest, model: str):
        super().__init__(call, model)
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[dict] = []

    def started(self, ev: Started) -> list[dict]:
        return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})]

    def tokens(self, run: list[Tokens]) -> list[dict]:
        """One chunk for the run's reasoning, one for its answer, one per tool call it completed."""
        out = []
        reasoning = "".join(t.reasoning for t in run)
        content = "".join(t.text for t in run)
        for key, text, kept in (("reasoning_content", reasoning, self.reasoning), ("content", content, self.content)):
            if text:
                kept.append(text)
                out.append(self._delta({key: text}))
        for call in (c for t in run for c in t.tool_calls):
            out.append(self._delta({"tool_calls": [{"index": len(self.tool_calls), **call}]}))
            self.tool_calls.append(call)
        return out

    def _delta(self, delta: dict) -> dict:
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

    def _finish(self, ev: Done) -> str:
        return finish_reason(ev, bool(self.tool_calls))

    def _final_choice(self) -> dict:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish}

    def body(self) -> dict:
        content = "".join(self.content)
        message = {"role": "assistant", "content": content or (None if self.tool_calls else ""),
                   "reasoning_content": "".join(self.reasoning) or None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish}],
                "usage": self.usage}


class CompletionReply(_Reply):
    object = "text_completion"

    def __init__(self, call: ApiRequest, model: str):
        super().__init__(call, model)
        self.text: list[str] = []

    def started(self, ev: Started) -> list[dict]:
        return []

    def tokens(self, run: list[Tokens]) -> list[dict]:
        text = "".join(t.text for t in run)
        if not text:
            return []
        self.text.append(text)
        return [self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})]

    def _final_choice(self) -> dict:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": self.finish}

    def body(self) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": "".join(self.text), "logprobs": None, "finish_reason": self.finish}],
                "usage": self.usage}


def stream_error(ev: Error) -> dict:
    """An error after the stream began: one chunk in OpenAI's error shape (the SDKs raise it), then [DONE]."""
    return error_body(ev.code, ev.message, ev.param)
