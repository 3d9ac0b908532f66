"""A chat request (appliance.api.ChatRequest, OpenAI's shapes) -> the prompt text and the parser's start state.

    request = ChatRequest.from_body(body)         # an OpenAI chat-completions body, as the CLI and tests hold it
    prompt = encode_request(request, dialect)     # raises RequestError naming the field at fault
    ids = tokenizer.encode(prompt.text)           # special tokens recognized, no automatic BOS
    parser = OutputParser(dialect, thinking=prompt.thinking)

The API edges build the ChatRequest once (server/openai_api.py from the body, the Anthropic and Responses
APIs from their own shapes); it reaches the encoder as built.

Where the OpenAI vocabulary meets the reference encoder (spec §2.1, §2.5, §6, §9):

* `tool_choice: "required"` or a named function opens the call at the end of the prompt, as DeepSeek's
  recipe library does for required: `\n\n<｜DSML｜tool_calls>\n` (plus `<｜DSML｜invoke name="NAME">\n`
  when named), after an empty `</think>` in thinking mode (the shape of a thinking turn that went straight
  to a call). `ChatPrompt.forced` is that text: the output parser reads it before the model's output.
* Request `tools` (and `response_format`) go on the leading system message (V4 also a leading developer
  message); one with empty text is created at index 0 when there is none. `tool_choice: "none"` leaves
  the tools out of the prompt, so the model is not tempted to write markup nobody parses.
* Thinking is on unless switched off; `reasoning_effort: "none"` switches it off. Efforts: minimal, low
  and medium -> "low"; high, xhigh and no effort at all -> "high" (the model card's "Think High"); max ->
  "max"; V4.1 also takes an integer 1-100. On the April checkpoints "low" is plain thinking.
* V4.1 has no developer role; OpenAI means it as the system prompt, so it becomes one.
* On V4, a system message after the conversation started would be rendered as bare text with no turn
  after it (the reference has no system marker); it is sent as a user turn instead, as DeepSeek's own
  recipe library does. The first system messages keep the reference layout.
* Content-part lists are joined with a blank line, as the reference joins blocks; images and other
  non-text parts are refused: this server runs the text model. A user message whose content is an empty
  list adds no block to its turn (the reference renders nothing for it).
* A tool call whose `arguments` text is empty or blank keeps it as the one string parameter `arguments`,
  as the reference does with any text it cannot parse; other text that is no JSON object is refused.
* What the encoder renders as JSON (tool schemas, response formats, call arguments) may nest at most
  MAX_DEPTH levels: deeper is refused naming the field, never recursed into.
* A conversation may end with an assistant message: assistant prefill. Its text (and, in thinking mode,
  its reasoning) is the start of the model's answer: the prompt ends inside the assistant turn, with no
  end-of-sentence, and the model continues it. A prefill that already holds tool calls is refused.
"""

import json
from dataclasses import dataclass

from appliance.api import CHAT_ROLES, ChatRequest
from appliance.errors import RequestError, shown

from .dialects import IMAGE, THINK_CLOSE, Dialect
from .dsml import Tags
from .encoding import encode_messages

_EFFORTS = {"minimal": "low", "low": "low", "medium": "low", "high": "high", "xhigh": "high", "max": "max"}
MAX_DEPTH = 64  # nesting levels of a schema, a response format or arguments (a client may send 100,000)


def check_depth(value, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse JSON nested deeper than `limit` objects and arrays, naming the field (iteratively: a deep value
    must not reach the recursion of the JSON writers)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                raise RequestError(f"{where}: nested deeper than {limit} levels of objects and arrays", field=where)
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    thinking: bool  # the prompt ends in `<think>`: the output starts with reasoning
    reasoning_effort: str | int | None  # as the encoder got it (the dialect's table)
    messages: list[dict]  # as the encoder got them (validated, tools attached)
    forced: str = ""  # the end of `text` that opens a forced tool call: the parser reads it first


def encode_request(request: ChatRequest, dialect: Dialect) -> ChatPrompt:
    thinking, effort = read_thinking(request.thinking, request.reasoning_effort, dialect)
    messages = normalize_messages(request.messages, dialect)
    prefill = _check_last_turn(messages, dialect)
    tools = _tools(request.tools, request.tool_choice)
    messages = _attach(messages, tools, _response_format(request.response_format))
    text = encode_messages(messages, dialect, thinking=thinking, reasoning_effort=effort, prefill=prefill)
    forced = forced_call(request.tool_choice, dialect, thinking) if tools else ""
    if prefill and forced:
        raise RequestError("tool_choice: a forced tool call cannot follow an assistant prefill (the last message "
                           "is the assistant's answer begun): use auto, or end the conversation with a user turn",
                           field="tool_choice", value=request.tool_choice)
    # the output starts in reasoning when the prompt ends in <think> or inside a begun reasoning
    in_reasoning = thinking and not (prefill and messages[-1]["content"])
    return ChatPrompt(text + forced, in_reasoning, effort if thinking else None, messages, forced)


def forced_call(tool_choice, dialect: Dialect, thinking: bool) -> str:
    """The prompt's end that makes the model call a tool: none for auto (or no choice), the block opener for
    required, and the invoke of the named function after it for a named choice."""
    if tool_choice != "required" and not isinstance(tool_choice, dict):
        return ""
    tags = Tags.of(dialect)
    text = (THINK_CLOSE if thinking else "") + "\n\n" + tags.block_open + "\n"
    if isinstance(tool_choice, dict):
        text += tags.invoke_open + tool_choice["function"]["name"] + '">\n'
    return text


def read_thinking(switch: bool | None, value, dialect: Dialect) -> tuple[bool, str | int | None]:
    """(thinking on?, the encoder's effort value) from the request's switch and `reasoning_effort`."""
    if value == "none":
        if switch:
            raise RequestError("reasoning_effort='none' turns thinking off, but thinking is switched on",
                               field="reasoning_effort", value=value)
        return False, None
    if value is None:
        effort = "high"
    elif isinstance(value, str) and value in _EFFORTS:
        effort = _EFFORTS[value]
    elif dialect.effort_table == "numeric" and isinstance(value, int) and not isinstance(value, bool) \
            and 1 <= value <= 100:
        effort = value
    else:
        numeric = " or an integer 1..100" if dialect.effort_table == "numeric" else ""
        raise RequestError(f"reasoning_effort={value!r}: must be one of none, {', '.join(_EFFORTS)}{numeric}",
                           field="reasoning_effort", value=value)
    if dialect.effort_table == "april" and effort == "low":
        effort = None  # the April encoder knows only high (plain) and max
    return (True if switch is None else switch), effort


def _tools(tools, choice) -> list[dict] | None:
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError("tools: must be a list of {type: function, function: {name, ...}}", field="tools")
        for i, tool in enumerate(tools):
            _check_tool(tool, f"tools[{i}]")
    names = [t["function"]["name"] for t in tools or []]
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tool_choice={shown(choice)}: must be auto, none, required or "
                               '{"type": "function", "function": {"name": ...}}', field="tool_choice", value=choice)
        name = fn["name"]
        if name not in names:
            raise RequestError(f"tool_choice.function.name={name!r}: not one of the request's tools "
                               f"({', '.join(names) or 'none given'})", field="tool_choice.function.name", value=name)
    elif choice not in (None, "auto", "none", "required"):
        raise RequestError(f"tool_choice={shown(choice)}: must be auto, none, required or "
                           '{"type": "function", "function": {"name": ...}}', field="tool_choice", value=choice)
    elif choice == "required" and not names:
        raise RequestError("tool_choice='required' needs tools", field="tool_choice", value=choice)
    return tools if tools and choice != "none" else None


def _check_tool(tool, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise RequestError(f"{where}: must be {{type: function, function: {{name, ...}}}}", field=f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"{where}.function: must be an object with a name", field=f"{where}.function")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"{where}.function.name: must be a non-empty string", field=f"{where}.function.name",
                           value=fn.get("name"))
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise RequestError(f"{where}.function.parameters: must be a JSON schema object",
                           field=f"{where}.function.parameters")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise RequestError(f"{where}.function.description: must be a string", field=f"{where}.function.description")
    check_depth(fn, f"{where}.function")


def _response_format(rf) -> dict | None:
    """json_object and json_schema are rendered as the reference renders a message's `response_format`: the
    object itself, after "## Response Format". text (the default) adds nothing."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object" or (kind == "json_schema" and isinstance(rf.get("json_schema"), dict)):
        check_depth(rf, "response_format")
        return rf
    if kind == "json_schema":
        raise RequestError("response_format.json_schema: must be an object ({name, schema})",
                           field="response_format.json_schema")
    raise RequestError(f"response_format.type={kind!r}: must be text, json_object or json_schema",
                       field="response_format.type", value=kind)


def _attach(messages: list[dict], tools: list[dict] | None, response_format: dict | None) -> list[dict]:
    if not tools and not response_format:
        return messages
    if messages[0]["role"] in ("system", "developer"):
        lead, rest = dict(messages[0]), messages[1:]
    else:
        lead, rest = {"role": "system", "content": ""}, messages
    if tools:
        lead["tools"] = tools
    if response_format:
        lead["response_format"] = response_format
    return [lead, *rest]


def _check_last_turn(messages: list[dict], dialect: Dialect) -> bool:
    """The model answers a user turn: the conversation must end with one (a trailing reminder aside), or
    with the assistant's answer begun (returns True: a prefill the model continues)."""
    i = max((k for k, m in enumerate(messages) if m["role"] != "latest_reminder"), default=0)
    role = messages[i]["role"]
    if role in ("user", "tool", "developer") or (role == "system" and i > 0 and dialect.system_token):
        return False
    if role == "assistant" and i == len(messages) - 1 and i > 0:
        if messages[i].get("tool_calls"):
            raise RequestError(f"messages[{i}].tool_calls: an assistant prefill (the last message, continued by "
                               "the model) cannot hold tool calls: send their results as tool messages",
                               field=f"messages[{i}].tool_calls")
        return True
    raise RequestError(f"messages[{i}].role={role!r}: the conversation must end with a user or tool message for "
                       "the model to answer, or with an assistant message it continues (a prefill: the last "
                       "message, after at least one other)", field=f"messages[{i}].role", value=role)


def normalize_messages(messages, dialect: Dialect) -> list[dict]:
    """OpenAI messages -> the encoder's shape (every content a string), checked field by field."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty list", field="messages")
    out, started = [], False
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where}: must be an object with a role", field=where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"{where}.role={role!r}: must be one of {', '.join(CHAT_ROLES)}",
                               field=f"{where}.role", value=role)
        if role == "developer" and not dialect.developer_role:
            role = "system"
        if role == "system" and started and not dialect.system_token:
            role = "user"
        started = started or role != "system"
        out.append(_message(m, role, where, dialect))
    return out


def _message(m: dict, role: str, where: str, dialect: Dialect) -> dict:
    if role == "assistant":
        return _assistant(m, where, dialect)
    if role == "user" and m.get("content") == []:
        return {"role": "user", "content": None}  # no parts: no block in its turn (encoding.py)
    content = _text(m.get("content"), f"{where}.content", dialect)
    if role == "developer" and not content:
        raise RequestError(f"{where}.content: a developer message needs text", field=f"{where}.content")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RequestError(f"{where}.tool_call_id: must be the id of the call this result answers",
                               field=f"{where}.tool_call_id", value=call_id)
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    return {"role": role, "content": content}


def _assistant(m: dict, where: str, dialect: Dialect) -> dict:
    out = {"role": "assistant", "content": _text(m.get("content"), f"{where}.content", dialect, allow_none=True)}
    name = "reasoning_content" if "reasoning_content" in m else "reasoning"  # vLLM and OpenRouter say reasoning
    reasoning = m.get(name)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise RequestError(f"{where}.{name}: must be a string", field=f"{where}.{name}")
        out["reasoning_content"] = reasoning
    calls = m.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls: must be a list", field=f"{where}.tool_calls")
    out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _tool_call(call, where: str) -> dict:
    if not isinstance(call, dict) or call.get("type", "function") != "function" \
            or not isinstance(call.get("function"), dict):
        raise RequestError(f"{where}: must be {{id, type: function, function: {{name, arguments}}}}", field=where)
    fn = call["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"{where}.function.name: must be a non-empty string", field=f"{where}.function.name",
                           value=fn.get("name"))
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise RequestError(f"{where}.id: must be a string", field=f"{where}.id", value=call_id)
    arguments = _arguments(fn.get("arguments"), f"{where}.function.arguments")
    return {"id": call_id or "", "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def _arguments(value, where: str) -> dict:
    """A call's arguments as an object: OpenAI sends JSON text; a dict, or JSON text of JSON text (V4.1's
    reference takes both), is accepted too. No arguments at all is none; empty or blank text is the one
    string parameter `arguments`, as the reference renders text it cannot parse."""
    if value is None:
        return {}
    if isinstance(value, str) and not value.strip():
        return {"arguments": value}
    parsed, error = value, "not JSON"
    for _ in range(2):
        if not isinstance(parsed, str):
            break
        try:
            parsed = json.loads(parsed)
        except RecursionError:
            raise RequestError(f"{where}: nested deeper than {MAX_DEPTH} levels of objects and arrays",
                               field=where) from None
        except ValueError as e:
            error = f"not JSON: {e}"
            break
    if isinstance(parsed, dict):
        check_depth(parsed, where)
        return parsed
    if not isinstance(parsed, str):
        error = f"got a JSON {type(parsed).__name__}"
    raise RequestError(f"{where}: must be a JSON object ({error})", field=where, value=value)


def _text(content, where: str, dialect: Dialect, allow_none: bool = False) -> str:
    if content is None and allow_none:
        return ""
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                what = f"{kind} parts are not supported (text-only model)" if kind else "must be {type: text, text}"
                raise RequestError(f"{where}[{k}]: {what}", field=f"{where}[{k}]", value=kind)
            parts.append(part["text"])
        content = "\n\n".join(parts)
    if not isinstance(content, str):
        raise RequestError(f"{where}: must be a string or a list of text parts", field=where)
    if dialect.special_tokens.get(IMAGE) is not None and IMAGE in content:
        raise RequestError(f"{where}: holds the image placeholder {IMAGE} as text", field=where)
    return content
