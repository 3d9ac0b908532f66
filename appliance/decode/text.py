"""One request's output as text, outside the request loop and the device work: ids in, what a `Tokens` event
shows out.

A `TextStream` decodes the ids as they come (StreamDecoder: never half a character), holds back text that
may begin a stop string until it cannot, ends the output at the first stop string (the ids after the one
that completed it are not kept, nor is any text from the stop string on), and for a chat request passes
the text through the output parser (answer, reasoning, tool calls). Stop strings match the model's text as
decoded, markup included. The loop decides EOS and max_tokens on ids before it feeds them.
"""

from appliance.model.tokenizer import StreamDecoder

from .chat import ChatOutput

Shown = tuple[str, str, list[dict]]  # what an event shows: answer text, reasoning text, tool calls


class TextStream:
    def __init__(self, tokenizer, stops: list[str], chat: ChatOutput | None):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = stops
        self.chat = chat
        self.text = ""  # emitted: a stop string may start in it and end in the next piece
        self.held = ""  # decoded but not emitted: it may be the start of a stop string
        self.stop: str | None = None  # the stop string that ended the output

    def feed(self, ids: list[int]) -> tuple[list[int], Shown]:
        """The ids the output keeps (all of them, or up to the one whose text completes a stop string: then
        `stop` names it and the output has ended) and what their text shows now."""
        piece = ""
        for n, token in enumerate(ids, 1):
            self.held += self.decoder.push([token])
            text = self.text + piece + self.held
            at, self.stop = _find_stop(text, self.stops, len(self.text) + len(piece))
            if at is not None:
                piece, self.held = text[len(self.text):at], ""
                ids = ids[:n]
                break
            keep = _stop_prefix(self.held, self.stops)
            piece, self.held = piece + self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.text += piece
        return ids, self._shown(piece)

    def finish(self) -> Shown | None:
        """What is left to show at the end (text held back, the parser's last word), or None: after a stop
        string nothing more is text."""
        tail = self.held + self.decoder.flush() if self.stop is None else ""
        shown = self.chat.finish(tail) if self.chat is not None else (tail, "", [])
        return shown if any(shown) else None

    def _shown(self, piece: str) -> Shown:
        return self.chat.feed(piece) if self.chat is not None else (piece, "", [])


def _stop_prefix(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could begin a stop string (held back until they cannot)."""
    for k in range(min(len(text), max(map(len, stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


def _find_stop(text: str, stops: list[str], new_from: int) -> tuple[int | None, str | None]:
    """(index where the earliest stop string starts, that string), if one ends in the new part of `text`."""
    best, which = None, None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best, which = i, s
    return best, which
