"""The Anthropic Messages API (`POST /v1/messages`) without I/O: a request body -> an Engine API chat request
(`messages_call`), engine events -> the message body or its stream of events (`MessagesReply`), and
Anthropic's error shape. server/http_api.py moves the bytes.

The body is translated into the OpenAI shapes the engine's chat encoder reads:
- `system` (text or text blocks) -> a system message;
- user blocks: `text` -> user text, `tool_result` (`tool_use_id`, text content) -> a tool message; images
  and documents are refused (text model);
- assistant blocks: `text` -> content, `thinking` -> reasoning_content, `tool_use` -> a tool call whose
  arguments are its `input`;
- `tools` (`name`, `description`, `input_schema`) -> functions; `tool_choice` auto / any / tool / none ->
  auto / required / the named function / none;
- `thinking` {"type": "enabled" | "adaptive"} -> thinking on, {"type": "disabled"} -> off, absent -> the
  model's default (thinking on, as the model card recommends); `budget_tokens` is not a switch here.
`max_tokens` is required, as Anthropic requires it. `stop_sequences`, `temperature` (0..1), `top_p`,
`top_k`, `stream`; unknown fields are ignored. `POST /v1/messages/count_tokens` takes the same body (without
`max_tokens`) and answers `{"input_tokens": N}`: the prompt's length as the engine encodes it.

The reply: a `thinking` block (reasoning; its `signature` is empty: nothing here signs), a `text` block,
then one `tool_use` block per call (`input` the parsed arguments). `stop_reason`: end_turn, max_tokens,
stop_sequence or tool_use. Usage: `input_tokens` are the prompt tokens not read from the cache,
`cache_read_input_tokens` those reused from the previous request's state.
"""

import json
import secrets

from appliance.api import TOP_K, TOP_P, ChatRequest, Done, Error, Request, Sampling, Started, Tokens
from appliance.chat import check_depth
from appliance.errors import RequestError, shown

from . import fields
from .openai_api import ApiRequest, checked

# Error code -> (Anthropic error type).
ERROR_TYPES = {"invalid_request": "invalid_request_error", "context_length_exceeded": "invalid_request_error",
               "unauthorized": "authentication_error", "forbidden": "permission_error", "not_found": "not_found_error",
               "method_not_allowed": "invalid_request_error", "timeout": "invalid_request_error",
               "too_large": "request_too_large", "unsupported_media_type": "invalid_request_error",
               "busy": "rate_limit_error", "not_ready": "overloaded_error", "internal": "api_error",
               "cancelled": "api_error"}
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def error_body(code: str, message: str, param: str | None = None) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(code, "api_error"), "message": message}}


def _text_of(content, where: str) -> str:
    """A block's content: a string, or text blocks joined (tool results may be either)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else None
                raise RequestError(f"{where}[{k}]: only text blocks are supported here (got {shown(kind)}): this "
                                   "server runs a text model", field=f"{where}[{k}]", value=kind)
            parts.append(block["text"])
        return "\n\n".join(parts)
    raise RequestError(f"{where}: must be text or a list of text blocks", field=where)


def _user(blocks, where: str) -> list[dict]:
    """User blocks -> user and tool messages, in the order given."""
    if isinstance(blocks, str):
        return [{"role": "user", "content": blocks}]
    if not isinstance(blocks, list):
        raise RequestError(f"{where}: must be text or a list of content blocks", field=where)
    out: list[dict] = []
    for k, block in enumerate(blocks):
        at = f"{where}[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n\n" + block["text"]
            else:
                out.append({"role": "user", "content": block["text"]})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise RequestError(f"{at}.tool_use_id: must be the id of the tool_use it answers",
                                   field=f"{at}.tool_use_id")
            text = _text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise RequestError(f"{at}.type={shown(kind)}: user blocks may be text or tool_result (a text model)",
                               field=f"{at}.type", value=kind)
    return out


def _assistant(blocks, where: str) -> dict:
    if isinstance(blocks, str):
        return {"role": "assistant", "content": blocks}
    if not isinstance(blocks, list):
        raise RequestError(f"{where}: must be text or a list of content blocks", field=where)
    text, reasoning, calls = [], [], []
    for k, block in enumerate(blocks):
        at = f"{where}[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                raise RequestError(f"{at}: a tool_use needs an id and a name", field=at)
            if not isinstance(block.get("input", {}), dict):
                raise RequestError(f"{at}.input: must be an object", field=f"{at}.input")
            check_depth(block.get("input", {}), f"{at}.input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        else:
            raise RequestError(f"{at}.type={shown(kind)}: assistant blocks may be text, thinking or tool_use",
                               field=f"{at}.type", value=kind)
    message = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(body: dict) -> list[dict]:
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: required: a non-empty list of {role: user | assistant, content}",
                           field="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user(m.get("content"), f"{where}.content")
        elif role == "assistant":
            out.append(_assistant(m.get("content"), f"{where}.content"))
        else:
            raise RequestError(f"{where}.role={shown(role)}: must be user or assistant (system goes in `system`)",
                               field=f"{where}.role", value=role)
    return out


def _tools(body: dict) -> tuple[list[dict] | None, str | dict | None]:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools: must be a list of {name, description, input_schema}", field="tools")
    functions = []
    for k, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise RequestError(f"tools[{k}].name: must be a non-empty string", field=f"tools[{k}].name")
        fn = {"name": t["name"], "description": t.get("description", ""), "parameters": t.get("input_schema", {})}
        functions.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is None:
        mapped = None
    elif kind in ("auto", "any", "none"):
        mapped = {"auto": "auto", "any": "required", "none": "none"}[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise RequestError(f"tool_choice={shown(choice)}: must be {{type: auto | any | none}} or {{type: tool, name}}",
                           field="tool_choice", value=choice)
    return functions or None, mapped


def _thinking(body: dict) -> bool | None:
    value = body.get("thinking")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise RequestError(f'thinking={shown(value)}: must be {{"type": "enabled" | "disabled"}}', field="thinking",
                           value=value)
    return kind != "disabled"


def messages_call(body, counting: bool = False) -> ApiRequest:
    """`counting`: a count_tokens body (no max_tokens, nothing generated)."""
    body = fields.body_object(body)
    max_tokens = fields.integer(body, "max_tokens", 1)
    if max_tokens is None and not counting:
        raise RequestError("max_tokens: required (an integer of at least 1)", field="max_tokens")
    tools, tool_choice = _tools(body)
    sampling = Sampling(temperature=fields.number(body, "temperature", 0.0, 1.0),  # Anthropic's range
                        top_p=fields.number(body, "top_p", *TOP_P, low_open=True),
                        top_k=fields.integer(body, "top_k", *TOP_K) or 0)
    chat = ChatRequest(_messages(body), tools=tools, tool_choice=tool_choice, thinking=_thinking(body))
    req = Request(id="msg_" + secrets.token_hex(12), chat=chat, max_tokens=max_tokens, sampling=sampling,
                  stop=fields.stop_list(body, "stop_sequences"))
    return ApiRequest(checked(req), fields.boolean(body, "stream"), False)


def count_call(body) -> ApiRequest:
    """`POST /v1/messages/count_tokens`: the messages, system, tools and thinking of a Messages body."""
    return messages_call(body, counting=True)


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessagesReply:
    """Events of one request -> (event name, data) pairs (streaming) and the message body (not). Blocks
    open and close as the kind of output changes: thinking, text, one per tool call."""

    def __init__(self, call: ApiRequest, model: str):
        self.id = call.request.id
        self.model = model
        self.blocks: list[dict] = []
        self.open: str | None = None  # the kind of the block being streamed
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}

    def _message(self, content: list) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": dict(self.usage)}

    def started(self, ev: Started) -> list[tuple[str, dict]]:
        self.usage["input_tokens"] = ev.prompt_tokens - ev.cached_tokens
        self.usage["cache_read_input_tokens"] = ev.cached_tokens
        return [("message_start", {"type": "message_start", "message": self._message([])})]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        key, delta_type = ("thinking", "thinking_delta") if kind == "thinking" else ("text", "text_delta")
        out = []
        if self.open != kind:
            out += self._close()
            block = {"type": kind, key: ""} | ({"signature": ""} if kind == "thinking" else {})
            self.blocks.append(block)
            self.open = kind
            out.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                "content_block": dict(block)}))
        self.blocks[-1][key] += text
        out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                            "delta": {"type": delta_type, key: text}}))
        return out

    def tokens(self, run: list[Tokens]) -> list[tuple[str, dict]]:
        out = []
        for t in run:
            if t.reasoning:
                out += self._text("thinking", t.reasoning)
            if t.text:
                out += self._text("text", t.text)
            for call in t.tool_calls:
                out += self._close()
                fn = call["function"]
                block = {"type": "tool_use", "id": _tool_id(call["id"]), "name": fn["name"], "input": {}}
                self.blocks.append({**block, "input": json.loads(fn["arguments"])})
                index = len(self.blocks) - 1
                out += [("content_block_start", {"type": "content_block_start", "index": index,
                                                 "content_block": block}),
                        ("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": {"type": "input_json_delta",
                                                           "partial_json": fn["arguments"]}}),
                        ("content_block_stop", {"type": "content_block_stop", "index": index})]
        return out

    def done(self, ev: Done) -> list[tuple[str, dict]]:
        calls = any(b["type"] == "tool_use" for b in self.blocks)
        if ev.finish_reason == "stop" and ev.stop_sequence is not None:
            self.stop_reason, self.stop_sequence = "stop_sequence", ev.stop_sequence
        else:
            self.stop_reason = "tool_use" if calls and ev.finish_reason == "stop" else STOP_REASONS.get(
                ev.finish_reason, "end_turn")
        self.usage["output_tokens"] = ev.usage["completion_tokens"]
        return self._close() + [  # usage: cumulative, as the current API streams it
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                                  "stop_sequence": self.stop_sequence},
                               "usage": dict(self.usage)}),
            ("message_stop", {"type": "message_stop"})]

    def body(self) -> dict:
        return self._message(self.blocks)

    def stream_error(self, ev: Error) -> dict:
        return stream_error(ev)


def stream_error(ev: Error) -> dict:
    return error_body(ev.code, ev.message, ev.param)
