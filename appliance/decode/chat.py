"""Chat requests in the request loop, with the chat wing (appliance.chat) bound to one checkpoint: the
request's messages -> prompt ids in the checkpoint's dialect, and the model's text -> answer, reasoning and
tool calls for the `Tokens` events, never a special token or DSML markup.

The prompt text is tokenized whole with the special tokens recognized and no automatic BOS (the encoder
wrote BOS), so `<｜User｜>` or `｜DSML｜` is one id, as the reference stacks tokenize it.
"""

from appliance.api import Request
from appliance.chat import OutputParser, TextDelta, encode_request
from appliance.chat.dialects import ASSISTANT, DSML, THINK_CLOSE, THINK_OPEN, USER, Dialect
from appliance.errors import RequestError

# Without these as single tokens the prompt would be BPE text the model never saw as markers.
_NEEDED = (USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML)


class ChatOutput:
    """One request's output parser; `feed` and `finish` return (answer text, reasoning text, tool calls)."""

    def __init__(self, dialect: Dialect, thinking: bool, forced: str):
        self.parser = OutputParser(dialect, thinking=thinking)
        self.parser.feed(forced)  # the forced call's opening: markup, nothing to show

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        return _split(self.parser.feed(text)) if text else ("", "", [])

    def finish(self, text: str = "") -> tuple[str, str, list[dict]]:
        content, reasoning, calls = self.feed(text)
        more = _split(self.parser.finish())
        return content + more[0], reasoning + more[1], calls + more[2]


def _split(deltas) -> tuple[str, str, list[dict]]:
    content, reasoning, calls = [], [], []
    for d in deltas:
        if isinstance(d, TextDelta):
            (reasoning if d.channel == "reasoning" else content).append(d.text)
        else:
            calls.append(d.call())
    return "".join(content), "".join(reasoning), calls


def chat_prompt(req: Request, dialect: Dialect, tokenizer) -> tuple[list[int], ChatOutput]:
    """The prompt ids of a chat request and the parser of its output. Raises RequestError naming the field."""
    if not tokenizer.vocab_size:
        raise RequestError("this model has no tokenizer.json: send input_ids instead of messages", field="messages")
    missing = [t for t in _NEEDED if tokenizer.token_id(t) is None]
    if missing:
        raise RequestError(f"messages: this checkpoint's tokenizer has no {', '.join(missing)} token: chat needs "
                           f"DeepSeek's special tokens; send prompt or input_ids", field="messages")
    prompt = encode_request(req.chat, dialect)
    return tokenizer.encode(prompt.text), ChatOutput(dialect, prompt.thinking, prompt.forced)
