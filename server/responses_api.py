"""The OpenAI Responses API (`POST /v1/responses`) without I/O: a body -> an Engine API chat request
(`responses_call`), engine events -> the response object or its stream of typed events (`ResponsesReply`).
server/http_api.py moves the bytes. The openai-agents SDK and Codex-style clients speak it by default.

The body is translated into the chat shapes the engine's encoder reads:
- `instructions` -> a leading system message (not carried over by `previous_response_id`, as OpenAI does);
- `input`: text (one user message) or items: messages (`user`, `system`, `developer`, `assistant`; text
  content or `input_text` / `output_text` parts), `function_call` (joins the assistant message before it,
  or opens one), `function_call_output` (a tool message), `reasoning` (its text becomes the next
  assistant message's reasoning); images, files and other tools' items are refused (a text model);
- `tools`: function tools (`name`, `description`, `parameters`); `tool_choice` auto / none / required /
  {type: function, name}; `text.format` text / json_object / json_schema -> the response format;
  `reasoning.effort` (none: thinking off); `max_output_tokens`, `temperature`, `top_p`, `stream`;
- `previous_response_id`: the stored conversation of that response (its input and output items) goes
  before this input, so the prompt repeats the earlier one and the engine's prefix cache restores it
  instead of prefilling it again. Responses are stored (`store`, default true) in server memory, the
  newest STORED of them; a restart forgets them.

The reply: a `reasoning` item (its text as `reasoning_text` content; no summary), a `message` item with
one `output_text` part, one `function_call` item per call; `status` completed, or incomplete with
`incomplete_details.reason` max_output_tokens. Streamed: `response.created`, `response.in_progress`, each
item's added / delta / done events, `response.completed` or `response.incomplete`, every event numbered
(`sequence_number`). Usage carries `input_tokens_details.cached_tokens`; reasoning tokens are not counted
apart (0).
"""

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from appliance.api import TEMPERATURE, TOP_P, ChatRequest, Done, Error, Request, Sampling, Started, Tokens
from appliance.errors import RequestError, shown

from . import fields
from .openai_api import checked, error_body

STORED = 256  # responses kept for previous_response_id, newest first
STATUS = {"length": "incomplete", "stop": "completed", "cancelled": "incomplete"}
ECHOED = ("instructions", "tools", "tool_choice", "temperature", "top_p", "max_output_tokens", "previous_response_id",
          "reasoning", "text", "metadata", "parallel_tool_calls", "truncation", "store")


class ResponseStore:
    """The conversations of recent responses (input items then output items, in input form), by id."""

    def __init__(self, capacity: int = STORED):
        self.capacity = capacity
        self.items: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, response_id: str) -> list[dict] | None:
        return self.items.get(response_id)

    def put(self, response_id: str, items: list[dict]) -> None:
        self.items[response_id] = items
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)


@dataclass
class ResponsesCall:
    """What one body asks for; `items`: the whole conversation so far (a previous response's included), which
    the reply stores with its output when `store` is set."""

    request: Request
    stream: bool
    include_usage: bool
    items: list[dict]
    store: ResponseStore | None
    echo: dict = field(default_factory=dict)


def _text(content, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or parts of `kinds` joined (the encoder joins blocks alike)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be text or a list of {' / '.join(kinds)} parts", field=where)
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{k}].type={shown(kind)}: must be one of {', '.join(kinds)} with text (this "
                               "server runs a text model)", field=f"{where}[{k}]", value=kind)
        parts.append(part["text"])
    return "\n\n".join(parts)


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{name}: must be a string", field=f"{where}.{name}", value=value)
    return value


def _messages(items: list[dict]) -> list[dict]:
    """Input items -> chat messages."""
    out: list[dict] = []
    reasoning = None  # a reasoning item's text, for the assistant message that follows it
    for k, item in enumerate(items):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where}: must be an object (a message or an item)", field=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role={shown(role)}: must be user, system, developer or assistant",
                                   field=f"{where}.role", value=role)
            parts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            message = {"role": role, "content": _text(item.get("content"), f"{where}.content", parts)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant" and reasoning is None:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output", ("input_text",))
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            texts = item.get("content") or item.get("summary") or []
            reasoning = _text(texts, f"{where}.content", ("reasoning_text", "summary_text"))
        else:
            raise RequestError(f"{where}.type={shown(kind)}: must be message, function_call, function_call_output or "
                               "reasoning (this server runs a text model with function tools)", field=f"{where}.type",
                               value=kind)
    return out


def _tools(body: dict) -> tuple[list[dict] | None, str | dict | None]:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools: must be a list of {type: function, name, parameters}", field="tools")
    functions = []
    for k, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestError(f"tools[{k}].type={shown(kind)}: only function tools run here", field=f"tools[{k}].type",
                               value=kind)
        fn = {"name": t.get("name")}
        for name in ("description", "parameters"):
            if t.get(name) is not None:
                fn[name] = t[name]
        functions.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None and choice not in ("auto", "none", "required"):
        raise RequestError(f"tool_choice={shown(choice)}: must be auto, none, required or {{type: function, name}}",
                           field="tool_choice", value=choice)
    return functions or None, choice


def _response_format(body: dict) -> dict | None:
    fmt = fields.obj(fields.obj(body, "text"), "format")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise RequestError(f"text.format.type={shown(kind)}: must be text, json_object or json_schema",
                       field="text.format.type", value=kind)


def _effort(body: dict) -> tuple[str | None, bool | None]:
    effort = fields.obj(body, "reasoning").get("effort")
    if effort is None:
        return None, None
    if effort == "none":
        return None, False
    if not isinstance(effort, str):
        raise RequestError(f"reasoning.effort={shown(effort)}: must be none, minimal, low, medium, high or xhigh",
                           field="reasoning.effort", value=effort)
    return effort, None


def responses_call(body, store: ResponseStore) -> ResponsesCall:
    body = fields.body_object(body)
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input: required: text or a non-empty list of items", field="input")
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(previous) if isinstance(previous, str) else None
        if stored is None:
            raise RequestError(f"previous_response_id={shown(previous)}: no stored response with that id (responses "
                               f"are kept in memory, the newest {STORED}; send the whole input instead)",
                               field="previous_response_id", value=previous)
        items = stored + items
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions: must be a string", field="instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _messages(items)
    tools, tool_choice = _tools(body)
    effort, thinking = _effort(body)
    sampling = Sampling(temperature=fields.number(body, "temperature", *TEMPERATURE),
                        top_p=fields.number(body, "top_p", *TOP_P, low_open=True))
    chat = ChatRequest(messages, tools=tools, tool_choice=tool_choice, thinking=thinking, reasoning_effort=effort,
                       response_format=_response_format(body))
    req = Request(id="resp_" + secrets.token_hex(12), chat=chat,
                  max_tokens=fields.integer(body, "max_output_tokens", 1), sampling=sampling)
    echo = {k: body.get(k) for k in ECHOED}
    echo["tools"] = body.get("tools") or []
    echo["tool_choice"] = body.get("tool_choice") or "auto"
    echo["parallel_tool_calls"] = body.get("parallel_tool_calls", True)
    echo["store"] = fields.boolean(body, "store", True)
    return ResponsesCall(checked(req), fields.boolean(body, "stream"), False, items,
                         store if echo["store"] else None, echo)


class ResponsesReply:
    """Events of one request -> (event name, data) pairs (streaming) and the response object (not). Items
    open and close as the kind of output changes: reasoning, the message, one per function call."""

    def __init__(self, call: ResponsesCall, model: str):
        self.call, self.model = call, model
        self.id = call.request.id
        self.created = int(time.time())
        self.items: list[dict] = []
        self.open: str | None = None  # the type of the item being streamed (reasoning, message)
        self.seq = 0
        self.status = "in_progress"
        self.incomplete: dict | None = None
        self.usage: dict | None = None

    def _event(self, data: dict) -> tuple[str, dict]:
        data["sequence_number"] = self.seq
        self.seq += 1
        return data["type"], data

    def _response(self) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "model": self.model, "output": [dict(i) for i in self.items], "usage": self.usage, "error": None,
                "incomplete_details": self.incomplete, "text": {"format": {"type": "text"}}, **{
                    k: v for k, v in self.call.echo.items() if v is not None}}

    def started(self, ev: Started) -> list[tuple[str, dict]]:
        self.prompt, self.cached = ev.prompt_tokens, ev.cached_tokens
        return [self._event({"type": "response.created", "response": self._response()}),
                self._event({"type": "response.in_progress", "response": self._response()})]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        item, index = self.items[-1], len(self.items) - 1
        self.open = None
        if item["type"] == "message":
            part = item["content"][0]
            done = [self._event({"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                                 "content_index": 0, "text": part["text"], "logprobs": []})]
        else:
            part = item["content"][0]
            done = [self._event({"type": "response.reasoning_text.done", "item_id": item["id"],
                                 "output_index": index, "content_index": 0, "text": part["text"]})]
        item["status"] = "completed"
        return done + [self._event({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                                    "content_index": 0, "part": dict(part)}),
                       self._event({"type": "response.output_item.done", "output_index": index, "item": dict(item)})]

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        out = []
        if self.open != kind:
            out += self._close()
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": []}
                item = {"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "in_progress",
                        "role": "assistant", "content": [part]}
            else:
                part = {"type": "reasoning_text", "text": ""}
                item = {"type": "reasoning", "id": "rs_" + secrets.token_hex(12), "summary": [], "content": [part],
                        "status": "in_progress"}
            self.items.append(item)
            self.open = kind
            index = len(self.items) - 1
            out += [self._event({"type": "response.output_item.added", "output_index": index,
                                 "item": {**item, "content": []}}),
                    self._event({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                                 "content_index": 0, "part": dict(part)})]
        item, index = self.items[-1], len(self.items) - 1
        item["content"][0]["text"] += text
        delta = ({"type": "response.output_text.delta", "logprobs": []} if kind == "message"
                 else {"type": "response.reasoning_text.delta"})
        out.append(self._event({**delta, "item_id": item["id"], "output_index": index, "content_index": 0,
                                "delta": text}))
        return out

    def tokens(self, run: list[Tokens]) -> list[tuple[str, dict]]:
        out = []
        for t in run:
            if t.reasoning:
                out += self._text("reasoning", t.reasoning)
            if t.text:
                out += self._text("message", t.text)
            for call in t.tool_calls:
                out += self._close()
                fn = call["function"]
                item = {"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": call["id"],
                        "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}
                self.items.append(item)
                index = len(self.items) - 1
                out += [self._event({"type": "response.output_item.added", "output_index": index,
                                     "item": {**item, "arguments": "", "status": "in_progress"}}),
                        self._event({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                                     "output_index": index, "delta": fn["arguments"]}),
                        self._event({"type": "response.function_call_arguments.done", "item_id": item["id"],
                                     "output_index": index, "name": fn["name"], "arguments": fn["arguments"]}),
                        self._event({"type": "response.output_item.done", "output_index": index, "item": dict(item)})]
        return out

    def done(self, ev: Done) -> list[tuple[str, dict]]:
        out = self._close()
        self.status = STATUS.get(ev.finish_reason, "completed")
        if self.status == "incomplete":
            self.incomplete = {"reason": "max_output_tokens"}
        u = ev.usage
        self.usage = {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
                      "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}
        if self.call.store is not None:
            self.call.store.put(self.id, self.call.items + [_as_input(i) for i in self.items])
        name = "response.completed" if self.status == "completed" else "response.incomplete"
        return out + [self._event({"type": name, "response": self._response()})]

    def body(self) -> dict:
        return self._response()

    def stream_error(self, ev: Error) -> dict:
        return self._event({"type": "error", "code": ev.code, "message": ev.message, "param": ev.param})[1]


def _as_input(item: dict) -> dict:
    """An output item as the input item that repeats it (previous_response_id)."""
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": [dict(p) for p in item["content"]]}
    return {k: v for k, v in item.items() if k != "status"}


def stream_error(ev: Error) -> dict:
    return {"type": "error", "code": ev.code, "message": ev.message, "param": ev.param}


__all__ = ["ResponseStore", "ResponsesCall", "ResponsesReply", "error_body", "responses_call", "stream_error"]
