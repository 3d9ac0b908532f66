"""Parses one DSML tool-call block off the front of a growing text buffer, one call at a time, for the
streaming output parser (`output.py`). No I/O and no emitting: `step` says what the buffer holds so far.

The grammar, V4 spelling (`dsml.py` has the V4.1 names), whitespace allowed between elements:

    block   = "\\n"{0,2} "<｜DSML｜tool_calls>" invoke* "</｜DSML｜tool_calls>"
    invoke  = '<｜DSML｜invoke name="' NAME '">' param* "</｜DSML｜invoke>"
    param   = '<｜DSML｜parameter name="' KEY '" string="' ("true" | "false") '">' VALUE "</｜DSML｜parameter>"

VALUE is raw text up to the parameter's closing tag, whatever it holds (DSML markup, the end-of-sentence text:
the reference reads a value to its closing tag).
A call's `arguments` is the reference's JSON text (spec §4.2 step 5): `{"KEY": V, ...}` with `", "` and
`": "`, V being the JSON-escaped string (`string="true"`) or the raw JSON text, kept verbatim
(`string="false"`; it must parse as JSON, or the call is malformed).

Every answer is final: `step` returns None ("need more text") unless no continuation of the buffer could
change its answer, so a caller that feeds text in any split gets the same answers as one fed it whole.
"""

import json
from dataclasses import dataclass

from .dialects import DSML, EOS
from .dsml import Tags

_DSML_OPEN = "<" + DSML


@dataclass(frozen=True)
class Call:
    """A complete, well-formed invoke ending at buffer index `end`."""

    end: int
    name: str
    arguments: str


@dataclass(frozen=True)
class Close:
    """The block ended at `end` (its closing tag, or the EOS the model wrote in its place after a call)."""

    end: int


@dataclass(frozen=True)
class Malformed:
    """The markup broke: buffer[:at] is not a tool call (the caller shows it as text) and parsing resumes
    as text at `at`. `at` is the start of the element that broke, so a marker there (EOS, a new block) is
    read again; it is past the `<｜DSML｜` when the block opener itself broke, so the caller always
    makes progress."""

    at: int
    reason: str


def _expect(buf: str, i: int, literal: str) -> bool | None:
    """True if `literal` is at buf[i:], None if buf ends on a prefix of it, False otherwise."""
    got = buf[i:i + len(literal)]
    if got == literal:
        return True
    return None if literal.startswith(got) else False


def _skip_space(buf: str, i: int) -> int:
    while i < len(buf) and buf[i].isspace():
        i += 1
    return i


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class BlockParser:
    """One block, from the newlines before `<｜DSML｜tool_calls>` to its end. Positions are indices into the
    caller's buffer, which must start where the block starts (and again right after each returned Call:
    the caller drops the call's text and calls `next_call`)."""

    def __init__(self, tags: Tags):
        self.tags = tags
        self.phase = self._open
        self.pos = 0  # next unread index
        self.fail_at = 0  # what a failure hands back as text: buffer[:fail_at]
        self.calls = 0  # calls returned from this block
        self.name = ""
        self.params: dict[str, str] = {}
        self.key, self.is_str, self.value_at, self.scan = "", True, 0, 0

    def step(self, buf: str, final: bool) -> Call | Close | Malformed | None:
        """The next thing the buffer holds; None while more text could still decide it. With `final` (no
        more text will come) the answer is never None."""
        while True:
            result = self.phase(buf)
            if result is not True:
                break
        if result is None and final:
            if self.phase == self._between and self.calls and not buf[self.pos:].strip():
                return Close(len(buf))  # the model stopped after a complete call
            return Malformed(self.fail_at, "the tool-call block ends unfinished")
        return result

    def next_call(self) -> None:
        """The caller dropped the text of the call just returned; the buffer now starts after it."""
        self.phase, self.pos, self.fail_at = self._between, 0, 0

    # Each phase returns True (advanced: go on), None (need more text) or a result.

    def _open(self, buf: str):
        i = self.pos
        while buf.startswith("\n", i) and i < self.pos + 2:
            i += 1
        self.fail_at = i + len(_DSML_OPEN)  # the caller found `<｜DSML｜` here, whole
        ok = _expect(buf, i, self.tags.block_open)
        if not ok:
            return None if ok is None else Malformed(self.fail_at, f"expected {self.tags.block_open!r}")
        self.pos, self.phase = i + len(self.tags.block_open), self._between
        return True

    def _between(self, buf: str):
        i = _skip_space(buf, self.pos)
        if i == len(buf):
            return None
        self.fail_at = i
        if buf.startswith("</", i):
            ok = _expect(buf, i, self.tags.block_close)
            if ok:
                return Close(i + len(self.tags.block_close))
            return None if ok is None else Malformed(i, f"expected {self.tags.invoke_open!r} or the block's end")
        if self.calls and EOS.startswith(buf[i:i + len(EOS)]):
            return Close(i) if len(buf) - i >= len(EOS) else None  # EOS stays for the caller
        ok = _expect(buf, i, self.tags.invoke_open)
        if not ok:
            return None if ok is None else Malformed(i, f"expected {self.tags.invoke_open!r} or the block's end")
        self.pos, self.phase = i + len(self.tags.invoke_open), self._name
        return True

    def _quoted(self, buf: str) -> int | None | Malformed:
        """The index of the `"` that ends the name or key starting at self.pos."""
        j = buf.find('"', self.pos)
        stop = len(buf) if j < 0 else j
        if any(c in buf[self.pos:stop] for c in "\n<>"):
            return Malformed(self.fail_at, "a tool or parameter name runs into markup")
        return None if j < 0 else j

    def _name(self, buf: str):
        j = self._quoted(buf)
        if not isinstance(j, int):
            return j
        ok = _expect(buf, j, '">')
        if not ok:
            return None if ok is None else Malformed(self.fail_at, "expected '\">' after the tool name")
        if j == self.pos:
            return Malformed(self.fail_at, "a tool call without a name")
        self.name, self.params = buf[self.pos:j], {}
        self.pos, self.phase = j + 2, self._params
        return True

    def _params(self, buf: str):
        i = _skip_space(buf, self.pos)
        if i == len(buf):
            return None
        if buf.startswith("</", i):
            ok = _expect(buf, i, self.tags.invoke_close)
            if ok:
                self.calls += 1
                args = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in self.params.items())
                return Call(i + len(self.tags.invoke_close), self.name, "{" + args + "}")
            return None if ok is None else Malformed(self.fail_at, f"tool {self.name!r}: expected a parameter "
                                                                   "or the call's end")
        ok = _expect(buf, i, self.tags.param_open)
        if not ok:
            return None if ok is None else Malformed(self.fail_at, f"tool {self.name!r}: expected a parameter "
                                                                   "or the call's end")
        self.pos, self.phase = i + len(self.tags.param_open), self._key
        return True

    def _key(self, buf: str):
        j = self._quoted(buf)
        if not isinstance(j, int):
            return j
        key = buf[self.pos:j]
        if key in self.params:
            return Malformed(self.fail_at, f"tool {self.name!r}: parameter {key!r} given twice")
        for flag in ("true", "false"):
            ok = _expect(buf, j, f'" string="{flag}">')
            if ok:
                self.key, self.is_str = key, flag == "true"
                self.value_at = self.scan = j + len(f'" string="{flag}">')
                self.phase = self._value
                return True
            if ok is None:
                return None
        return Malformed(self.fail_at, f'tool {self.name!r}: parameter {key!r} needs string="true" or "false"')

    def _value(self, buf: str):
        close = self.tags.param_close
        c = buf.find(close, self.scan)
        if c < 0:
            self.scan = max(self.value_at, len(buf) - len(close) + 1)  # a closing tag may still end the buffer
            return None
        raw = buf[self.value_at:c]
        if self.is_str:
            value = json.dumps(raw, ensure_ascii=False)
        else:
            try:
                json.loads(raw, parse_constant=_reject_constant)
            except (ValueError, RecursionError):
                return Malformed(self.fail_at, f'tool {self.name!r}: parameter {self.key!r} is string="false" '
                                               "but not JSON")
            value = raw
        self.params[self.key] = value
        self.pos, self.phase = c + len(close), self._params
        return True
