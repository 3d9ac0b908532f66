"""DSML, the tool-call markup of V4 and V4.1: its tags, the tools block of the system prompt, and tool
calls rendered into assistant history (spec §2.6, §2.7, §3.1). Parsing it back is `toolblock.py`.

A block of two calls, V4 spelling (V4.1 writes ` calls`, ` invoke`, ` parameter`, each with a leading space;
`｜DSML｜` is one token, everything around it ordinary text):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    </｜DSML｜invoke>
    <｜DSML｜invoke name="now">

    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String values are written raw with `string="true"`; any other JSON value as `json.dumps` text with
`string="false"`. A call without parameters keeps an empty line.
"""

import json
from dataclasses import dataclass

from .dialects import DSML, Dialect


@dataclass(frozen=True)
class Tags:
    """The literal pieces of one dialect's markup."""

    block_open: str  # <｜DSML｜tool_calls>
    block_close: str  # </｜DSML｜tool_calls>
    invoke_open: str  # <｜DSML｜invoke name="      (the name and `">` follow)
    invoke_close: str  # </｜DSML｜invoke>
    param_open: str  # <｜DSML｜parameter name="   (key, `" string="`, true|false, `">` follow)
    param_close: str  # </｜DSML｜parameter>

    @classmethod
    def of(cls, dialect: Dialect) -> "Tags":
        b, i, p = dialect.tag("tool_calls"), dialect.tag("invoke"), dialect.tag("parameter")
        return cls(f"<{DSML}{b}>", f"</{DSML}{b}>", f'<{DSML}{i} name="', f"</{DSML}{i}>", f'<{DSML}{p} name="',
                   f"</{DSML}{p}>")


_TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{D}{B}>" \
block like the following:

<{D}{B}>
<{D}{I} name="$TOOL_NAME">
<{D}{P} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}{P}>
...
</{D}{I}>
<{D}{I} name="$TOOL_NAME2">
...
</{D}{I}>
</{D}{B}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{SCHEMAS}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def tools_prompt(tools: list[dict], dialect: Dialect) -> str:
    """The "## Tools" block (it ends with one newline). Each tool contributes its `function` object as one
    line of `json.dumps` with Python's default separators, keys in their given order."""
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (_TOOLS_PROMPT.replace("{D}", DSML).replace("{B}", dialect.tag("tool_calls"))
            .replace("{I}", dialect.tag("invoke")).replace("{P}", dialect.tag("parameter"))
            .replace("{SCHEMAS}", schemas))


def arguments_object(arguments) -> dict:
    """A call's `function.arguments` as the reference reads it: a dict as it is, a JSON string parsed (twice
    when it holds JSON text itself, as V4.1 accepts); text that is no JSON object becomes the one string
    parameter `arguments` (the V4 reference's fallback)."""
    if isinstance(arguments, dict):
        return arguments
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def render_tool_calls(tool_calls: list[dict], dialect: Dialect) -> str:
    """The DSML block for an assistant message's OpenAI `tool_calls`."""
    tags = Tags.of(dialect)
    invokes = []
    for call in tool_calls:
        fn = call["function"]
        params = []
        for key, value in arguments_object(fn.get("arguments", {})).items():
            is_str = isinstance(value, str)
            text = value if is_str else json.dumps(value, ensure_ascii=False)
            params.append(f'{tags.param_open}{key}" string="{"true" if is_str else "false"}">{text}{tags.param_close}')
        invokes.append(f'{tags.invoke_open}{fn["name"]}">\n' + "\n".join(params) + f"\n{tags.invoke_close}")
    return tags.block_open + "\n" + "\n".join(invokes) + "\n" + tags.block_close
