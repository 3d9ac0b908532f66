"""The model's output text -> reasoning, content and tool calls, incrementally (spec §4.3) or at once.

    parser = OutputParser(dialect, thinking=prompt.thinking)   # thinking: the prompt ended with <think>
    for piece in detokenized_pieces:                            # any split, down to one character
        for delta in parser.feed(piece): ...                    # TextDelta | ToolCallDelta
    for delta in parser.finish(): ...                           # the end of generation
    parser.finish_reason, parser.malformed_tool_call, parser.result()

States: REASONING (the initial state exactly when the prompt ended with `<think>`), CONTENT, a DSML block
(`toolblock.py`), DONE (after EOS; later text is ignored). Markers are matched on decoded text:

* `</think>` ends reasoning; a stray one in content and any `<think>` are swallowed.
* `\\n\\n<｜DSML｜` opens a tool-call block, also from reasoning (the model sometimes forgets `</think>`):
  those two newlines (or fewer, when the model wrote fewer) are the marker's, not content; more newlines
  before them are content, as the reference reads them. The calls of a well-formed block are emitted one whole call at
  a time, when its `</｜DSML｜invoke>` arrives: arguments are validated before anyone sees them.
* EOS ends the turn. Other special tokens (BOS, role and task tokens) are never shown. Reasoning that
  never meets `</think>` stays reasoning: it was streamed as such and cannot be taken back.
* Text that may still become a marker (`</thi`, `\\n\\n<｜DS`) is held back and released as text once
  it cannot.

Malformed markup never raises: the text of the broken call (and what follows it up to the next marker)
is released as text of the channel it appeared in, and `malformed_tool_call` says why. Calls that were
complete before the break stay calls. Each decision waits until no later text could change it, so
`parse(text)` equals the streamed result for every split of `text`.
"""

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from .dialects import DSML, EOS, HIDDEN_TOKENS, THINK_CLOSE, THINK_OPEN, Dialect
from .dsml import Tags
from .toolblock import BlockParser, Call, Close, Malformed

REASONING, CONTENT, DONE = "reasoning", "content", "done"

_STRAY_CLOSE = "</" + DSML
_LITERALS = sorted((THINK_CLOSE, THINK_OPEN, EOS, _STRAY_CLOSE, *HIDDEN_TOKENS), key=len, reverse=True)
_MARKERS = re.compile(r"(?P<block>\n{0,2}<" + re.escape(DSML) + ")|" + "|".join(map(re.escape, _LITERALS)))
_PREFIXES = (*_LITERALS, "<" + DSML)  # every marker starts with "<"
_LONGEST = max(map(len, _PREFIXES))


@dataclass(frozen=True)
class TextDelta:
    channel: str  # "reasoning" or "content"
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One whole tool call (a streaming client gets it as a single OpenAI tool-call delta)."""

    index: int
    id: str
    name: str
    arguments: str  # JSON object text

    def openai(self) -> dict:
        """The OpenAI `choices[0].delta.tool_calls[k]` shape."""
        return {"index": self.index, **self.call()}

    def call(self) -> dict:
        """The OpenAI `message.tool_calls[k]` shape."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    content: str
    reasoning_content: str
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI message shape
    # "tool_calls" when calls were made, "stop" when the text held EOS, else None: the caller's own reason
    # (length, a stop string, or "stop" when it stripped the EOS token).
    finish_reason: str | None = None
    malformed_tool_call: str | None = None  # why DSML markup was shown as text; None when none was

    def as_dict(self) -> dict:
        return {"content": self.content, "reasoning_content": self.reasoning_content, "tool_calls": self.tool_calls,
                "finish_reason": self.finish_reason, "malformed_tool_call": self.malformed_tool_call}


def random_call_id(index: int) -> str:
    return "call_" + secrets.token_hex(12)


class OutputParser:
    """Streaming parser of one assistant turn. Not thread-safe; one per request."""

    def __init__(self, dialect: Dialect, *, thinking: bool, call_id: Callable[[int], str] = random_call_id):
        self.tags = Tags.of(dialect)
        self.call_id = call_id
        self.state = REASONING if thinking else CONTENT
        self.saw_eos = False
        self.malformed_tool_call: str | None = None
        self._buf = ""
        self._block: BlockParser | None = None
        self._block_from = CONTENT  # the channel a broken block's text goes back to
        self._text = {REASONING: [], CONTENT: []}
        self._calls: list[ToolCallDelta] = []
        self._out: list[TextDelta | ToolCallDelta] = []

    def feed(self, text: str) -> list[TextDelta | ToolCallDelta]:
        """Deltas that `text` makes final (possibly none: a marker may be in progress)."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[TextDelta | ToolCallDelta]:
        """The end of generation: held-back text is released, an unfinished call becomes text."""
        self._run(final=True)
        self.state = DONE
        return self._take()

    @property
    def finish_reason(self) -> str | None:
        return "tool_calls" if self._calls else "stop" if self.saw_eos else None

    def result(self) -> ParsedMessage:
        """Everything emitted so far, as one message."""
        return ParsedMessage("".join(self._text[CONTENT]), "".join(self._text[REASONING]),
                             [c.call() for c in self._calls], self.finish_reason, self.malformed_tool_call)

    def _take(self) -> list:
        out, self._out = self._out, []
        return out

    def _emit(self, channel: str, text: str) -> None:
        if not text:
            return
        self._text[channel].append(text)
        if self._out and isinstance(self._out[-1], TextDelta) and self._out[-1].channel == channel:
            text = self._out.pop().text + text
        self._out.append(TextDelta(channel, text))

    def _flag(self, reason: str) -> None:
        self.malformed_tool_call = self.malformed_tool_call or reason

    def _run(self, final: bool) -> None:
        while self.state != DONE:
            if self._block is not None:
                progressed = self._step_block(final)
            else:
                progressed = bool(self._buf) and self._step_text(final)
            if not progressed:
                return
        self._buf = ""  # after EOS nothing is part of the turn

    def _step_text(self, final: bool) -> bool:
        """Emit text up to the next marker and act on it; False when no marker is in the buffer."""
        buf = self._buf
        m = _MARKERS.search(buf)
        if m is None:
            keep = 0 if final else _held_back(buf)
            self._emit(self.state, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit(self.state, buf[:m.start()])
        if m.lastgroup == "block":
            self._buf = buf[m.start():]
            self._block, self._block_from = BlockParser(self.tags), self.state
            return True
        self._buf = buf[m.end():]
        marker = m.group()
        if marker == THINK_CLOSE and self.state == REASONING:
            self.state = CONTENT
        elif marker == EOS:
            self.state, self.saw_eos = DONE, True
        elif marker == _STRAY_CLOSE:
            self._flag("a DSML closing tag outside a tool-call block")
            self._emit(self.state, marker)
        return True  # any other marker is swallowed

    def _step_block(self, final: bool) -> bool:
        result = self._block.step(self._buf, final)
        if result is None:
            return False
        if isinstance(result, Call):
            index = len(self._calls)
            self._calls.append(ToolCallDelta(index, self.call_id(index), result.name, result.arguments))
            self._out.append(self._calls[-1])
            self._buf = self._buf[result.end:]
            self._block.next_call()
            self._block_from = CONTENT  # once a call is out, reasoning is over
        elif isinstance(result, Close):
            self._buf = self._buf[result.end:]
            self._block, self.state = None, CONTENT
        elif isinstance(result, Malformed):
            self._flag(result.reason)
            self._block, self.state = None, self._block_from
            self._emit(self.state, self._buf[:result.at])
            self._buf = self._buf[result.at:]
        return True


def _held_back(buf: str) -> int:
    """How many characters at the end of `buf` could still begin a marker; up to two newlines directly
    before a possible `<｜DSML｜` belong to it (they are not content when a block follows)."""
    hold = len(buf)
    for p in range(max(0, len(buf) - _LONGEST), len(buf)):
        if buf[p] == "<" and any(m.startswith(buf[p:]) for m in _PREFIXES):
            hold = p
            break
    if ("<" + DSML).startswith(buf[hold:]):
        end = hold
        while hold > 0 and buf[hold - 1] == "\n" and end - hold < 2:
            hold -= 1
    return len(buf) - hold


def parse(text: str, dialect: Dialect, *, thinking: bool, call_id: Callable[[int], str] = random_call_id
          ) -> ParsedMessage:
    """The whole output at once; equal to what the streaming parser gives for any split of `text`."""
    parser = OutputParser(dialect, thinking=thinking, call_id=call_id)
    parser.feed(text)
    parser.finish()
    return parser.result()
