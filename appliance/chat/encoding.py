"""Messages -> prompt text, as DeepSeek's reference encoders (`encoding_dsv4.py` for V4 and 0731,
`encoding.py` for V4.1) write it. Spec: shared/spec/chat-encoding.md §2 and §3; the worked examples of §7
are the tests.

The layout, for a thinking-mode turn with tools (V4 spelling; V4.1 adds `<｜System｜>` and an effort line):

    <｜begin▁of▁sentence｜>{effort}{system}\n\n## Tools ...\n<｜User｜>{question}<｜Assistant｜><think>
    {reasoning}</think>{content}\n\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls><｜end▁of▁sentence｜>
    <｜User｜><tool_result>{r1}</tool_result>\n\n<tool_result>{r2}</tool_result><｜Assistant｜><think>

Messages arrive validated and in the reference's shape (request.py turns OpenAI requests into it): every
`content` a string; `tools` and `response_format` on the system (or V4 developer) message that carries
them; assistant `tool_calls` in OpenAI form. Not rendered: the internal quick-instruction `task` field and
`wo_eos` continuation, which chat clients never send.
"""

import json

from appliance.api import CHAT_ROLES
from appliance.errors import RequestError

from .dialects import ASSISTANT, LATEST_REMINDER, SYSTEM, THINK_CLOSE, THINK_OPEN, USER, Dialect
from .dsml import render_tool_calls, tools_prompt

_RESPONSE_FORMAT = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def encode_messages(messages: list[dict], dialect: Dialect, *, thinking: bool, reasoning_effort=None,
                    drop_thinking: bool = True, add_bos: bool = True, prefill: bool = False) -> str:
    """The prompt for `messages`. It ends with the generation header `<｜Assistant｜><think>` (thinking) or
    `<｜Assistant｜></think>` (chat) when the last turn is a user's; a conversation that ends with an
    assistant message gets no header. `prefill`: the last message is an assistant's answer begun, which the
    model continues: it is rendered without its end-of-sentence (the reference's `wo_eos`), and in thinking
    mode a prefill without content ends inside its reasoning (no `</think>`).

    `drop_thinking`: in thinking mode, earlier turns lose their reasoning unless any message carries tools
    (tool loops must see their reasoning again). `reasoning_effort` takes the dialect's own table
    (`Dialect.effort_text`)."""
    effort = dialect.effort_text(reasoning_effort) if thinking else ""
    msgs = _sort_tool_results(_merge_tool_results(messages, dialect))
    drop = thinking and drop_thinking and not any(m.get("tools") for m in msgs)
    if drop:
        msgs = _drop_old_thinking(msgs, dialect)
    last_user = _last_user_index(msgs, dialect)
    out = [dialect.bos] if add_bos else []
    for i, m in enumerate(msgs):
        if i == 0:
            out.append(SYSTEM + effort if dialect.system_token and (effort or m["role"] == "system") else effort)
        # Reasoning is shown for turns after the last user turn, and for all when nothing is dropped.
        keep = not drop or i > last_user
        begun = prefill and i == len(msgs) - 1
        out.append(_render(i, m, dialect, thinking and keep, begun))
        nxt = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if nxt in (None, "assistant", "latest_reminder") and _user_like(i, m, dialect):
            out.append(ASSISTANT + (THINK_OPEN if thinking and (not drop or i >= last_user) else THINK_CLOSE))
    return "".join(out)


def _user_like(i: int, m: dict, dialect: Dialect) -> bool:
    """Turns the model answers: user and developer turns, and in V4.1 a system message after the first."""
    return m["role"] in ("user", "developer") or (dialect.system_token and m["role"] == "system" and i > 0)


def _last_user_index(msgs: list[dict], dialect: Dialect) -> int:
    return max((i for i, m in enumerate(msgs) if _user_like(i, m, dialect)), default=-1)


def _render(i: int, m: dict, dialect: Dialect, show_reasoning: bool, begun: bool = False) -> str:
    role = m["role"]
    if role == "system":
        marker = SYSTEM if dialect.system_token and i > 0 else ""
        return marker + (m.get("content") or "") + _system_blocks(m, dialect)
    if role == "developer":
        if not dialect.developer_role:
            raise RequestError(f"messages[{i}].role='developer': {dialect.name} has no developer role",
                               field=f"messages[{i}].role", value=role)
        return USER + m["content"] + _system_blocks(m, dialect)
    if role == "user":
        return USER + "\n\n".join(_block_text(b) for b in m["blocks"])
    if role == "latest_reminder":
        return LATEST_REMINDER + (m.get("content") or "")
    if role == "assistant":
        content = m.get("content") or ""
        if begun:  # the answer so far: reasoning (closed once content began), content, no end-of-sentence
            reasoning = m.get("reasoning_content") or ""
            return (reasoning + (THINK_CLOSE if content else "") if show_reasoning else "") + content
        think = (m.get("reasoning_content") or "") + THINK_CLOSE if show_reasoning else ""
        calls = "\n\n" + render_tool_calls(m["tool_calls"], dialect) if m.get("tool_calls") else ""
        return think + content + calls + dialect.eos
    raise RequestError(f"messages[{i}].role={role!r}: must be one of {', '.join(CHAT_ROLES)}",
                       field=f"messages[{i}].role", value=role)


def _system_blocks(m: dict, dialect: Dialect) -> str:
    """The tools block and the response-format block that follow a system or developer message's text."""
    out = ""
    if m.get("tools"):
        out += "\n\n" + tools_prompt(m["tools"], dialect)
    if m.get("response_format"):
        out += _RESPONSE_FORMAT + json.dumps(m["response_format"], ensure_ascii=False)
    return out


def _block_text(block: dict) -> str:
    if block["type"] == "tool_result":
        return "<tool_result>" + block["content"] + "</tool_result>"
    return block["text"]


def _merge_tool_results(messages: list[dict], dialect: Dialect) -> list[dict]:
    """Tool results and user texts that follow each other become one user turn of blocks (V4 and V4.1 have no
    tool turn): a tool result joins the user turn before it or opens one, and so does a user text."""
    merged: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = {"type": "tool_result", "id": m.get("tool_call_id") or "", "content": m.get("content") or ""}
        elif role == "user":  # content None: an empty list of parts, no block at all
            block = None if m.get("content") is None else {"type": "text", "text": m["content"]}
        else:
            merged.append(m)
            continue
        if merged and merged[-1]["role"] == "user":
            merged[-1]["blocks"] += [block] if block else []
        else:
            merged.append({"role": "user", "blocks": [block] if block else []})
    return merged


def _sort_tool_results(msgs: list[dict]) -> list[dict]:
    """Puts the tool results of each user turn in the order of the calls of the last assistant turn that
    made calls, whatever order the client sent them in; text blocks keep their places. Unknown ids sort
    first (stable)."""
    order: dict[str, int] = {}
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if c.get("id")}
        elif m["role"] == "user":
            slots = [k for k, b in enumerate(m["blocks"]) if b["type"] == "tool_result"]
            if len(slots) > 1:
                results = sorted((m["blocks"][k] for k in slots), key=lambda b: order.get(b["id"], 0))
                for k, b in zip(slots, results):
                    m["blocks"][k] = b
    return msgs


def _drop_old_thinking(msgs: list[dict], dialect: Dialect) -> list[dict]:
    """Before the last user turn: assistant turns lose their reasoning and developer turns go (§2.2 step 3)."""
    last_user = _last_user_index(msgs, dialect)
    kept = []
    for i, m in enumerate(msgs):
        if i < last_user and m["role"] == "assistant":
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
        elif i < last_user and m["role"] not in ("user", "system", "latest_reminder", "assistant"):
            continue
        kept.append(m)
    return kept
