"""`appliance chat encode | parse`: see the prompt a chat-completions request becomes for a DeepSeek V4 / V4.1
checkpoint, and how a model output splits into reasoning, content and tool calls (appliance/chat).

Bad input is one line on stderr and exit status 2, as for every `appliance` command."""

import json
from pathlib import Path

import click

from appliance.api import ChatRequest
from appliance.chat import DIALECTS, encode_request, get_dialect, parse
from appliance.errors import ApplianceError

from .common import friendly

FAMILIES = list(DIALECTS)


@click.group()
def chat():
    """DeepSeek V4 / V4.1 chat encoding: request -> prompt text (encode), model output -> message (parse).

    \b
    Families: deepseek_v4 (V4-Flash April preview), deepseek_v4_0731 (V4-Flash-0731, its effort table),
    deepseek_v41 (V4.1-Flash, -1017)."""


@chat.command("encode")
@click.option("--family", type=click.Choice(FAMILIES), required=True, help="the checkpoint's prompt dialect")
@click.option("--request", "request_file", type=click.Path(path_type=Path), required=True,
              help="JSON file: an OpenAI chat-completions request body (messages, tools, tool_choice, "
                   "reasoning_effort, thinking or chat_template_kwargs.thinking, response_format)")
@click.option("--json", "as_json", is_flag=True,
              help='print {"prompt", "thinking", "ids"} (ids: with --model, else null)')
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="model directory whose tokenizer.json turns the prompt into ids (with --json)")
@friendly
def encode(family, request_file, as_json, model_dir):
    """Print the prompt text that a chat-completions request becomes."""
    dialect = get_dialect(family)
    prompt = encode_request(ChatRequest.from_body(_read_json(request_file, "--request")), dialect)
    if not as_json:
        click.echo(prompt.text, nl=False)
        return
    ids = _token_ids(prompt.text, dialect, model_dir) if model_dir is not None else None
    click.echo(json.dumps({"prompt": prompt.text, "thinking": prompt.thinking, "ids": ids}, ensure_ascii=False))


@chat.command("parse")
@click.option("--family", type=click.Choice(FAMILIES), required=True, help="the checkpoint's prompt dialect")
@click.option("--thinking", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="on: the prompt ended with <think>, the output starts with reasoning")
@click.option("--text", "text_file", type=click.Path(path_type=Path), required=True,
              help="file holding the model's output text, special tokens kept (UTF-8, read as it is)")
@click.option("--json", "as_json", is_flag=True,
              help='print {"content", "reasoning_content", "tool_calls", "finish_reason", "malformed_tool_call"}')
@friendly
def parse_output(family, thinking, text_file, as_json):
    """Split a model output into reasoning, content and tool calls (OpenAI shape)."""
    try:
        text = Path(text_file).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ApplianceError(f"--text {text_file}: no such file", field="text") from None
    except UnicodeDecodeError as e:
        raise ApplianceError(f"--text {text_file}: not UTF-8 text ({e})", field="text") from None
    message = parse(text, get_dialect(family), thinking=thinking == "on")
    if as_json:
        click.echo(json.dumps(message.as_dict(), ensure_ascii=False))
        return
    if message.reasoning_content:
        click.echo(f"reasoning: {message.reasoning_content}")
    click.echo(f"content: {message.content}")
    for k, call in enumerate(message.tool_calls):
        click.echo(f"tool call {k}: {call['function']['name']} {call['function']['arguments']}")
    click.echo(f"finish: {message.finish_reason or '(no EOS: length or stripped)'}")
    if message.malformed_tool_call:
        click.echo(f"malformed tool call, shown as text: {message.malformed_tool_call}")


def _read_json(path: Path, option: str):
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ApplianceError(f"{option} {path}: no such file", field=option.lstrip("-")) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApplianceError(f"{option} {path}: not a JSON file ({e})", field=option.lstrip("-")) from None


def _token_ids(text: str, dialect, model_dir: Path) -> list[int]:
    """The prompt's ids with the model's tokenizer: special tokens recognized, no automatic BOS. Refuses a
    tokenizer that would split a special token or give it another id than the dialect's."""
    from appliance.model.tokenizer import NoTokenizer, load_tokenizer

    if not Path(model_dir).is_dir():
        raise ApplianceError(f"--model {model_dir}: no such directory", field="model")
    tok = load_tokenizer(model_dir)
    if isinstance(tok, NoTokenizer):
        raise ApplianceError(f"--model {model_dir}: has no tokenizer.json to turn the prompt into ids", field="model")
    for token, want in dialect.special_tokens.items():
        if token in text and tok.encode(token) != [want]:
            raise ApplianceError(f"--model {model_dir}: its tokenizer encodes {token} as {tok.encode(token)}, "
                                 f"{dialect.name} needs the single id {want}", field="model")
    return tok.encode(text)
