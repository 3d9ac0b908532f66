"""decode.v1's one JSON policy: client messages are read by orjson, the library that writes the server's
frames, so every value that can reach a frame (an id, a ping's `t`) is one the encoder can write back.

orjson refuses what it cannot represent: strings with a lone surrogate (the escape "\\ud800" alone), numbers
beyond the range of a double (an integer of 400 digits, 1e400), NaN and Infinity, nesting deeper than 1024.
An integer beyond 64 bits but within a double's range it reads as a double, which the type and range checks
of each field then refuse. When orjson refuses a message, `loads` finds the first value at fault with the
standard library's parser (used only for this diagnosis, never for its result), so the error names the field
(`id`, `t`, `messages[0].content`) rather than the whole message.
"""

import json
import math

import orjson

from appliance.errors import RequestError, unicode_fault

INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # the integers orjson reads and writes as integers
MAX_DIGITS = 4300  # Python's own cap on int(str); a longer integer is simply too long


class UnrepresentableValue(RequestError):
    """A message orjson refuses for one value (`field`). `document` is what the standard parser read, each
    such value replaced by a marker: the caller may still find the message's own fields (its `id`) there."""

    def __init__(self, message: str, *, field: str, document):
        super().__init__(message, field=field)
        self.document = document


class _Fault:
    """A value the standard parser read but orjson cannot represent (stands in for it in the diagnosis)."""

    def __init__(self, why: str):
        self.why = why


def _number_text(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:12]}...{text[-4:]} ({len(text)} characters)"


def _read_int(text: str):
    if len(text.lstrip("-")) > MAX_DIGITS:
        return _Fault(f"the integer {_number_text(text)} is beyond 64 bits")
    value = int(text)
    return value if INT_MIN <= value <= INT_MAX else _Fault(f"the integer {_number_text(text)} is beyond 64 bits")


def _read_float(text: str):
    value = float(text)
    return value if math.isfinite(value) else _Fault(f"the number {_number_text(text)} is beyond the range of a "
                                                     f"double")


def _read_constant(text: str):
    return _Fault(f"{text} is not a JSON number")


def shown_key(key: str) -> str:
    """A key as a field name that can always be encoded (lone surrogates written as escapes)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def first_fault(value) -> tuple[str, str] | None:
    """(field, why) of the first value, in document order, that orjson cannot represent; None when there is
    none. Iterative: a message may be nested 1,000 deep."""
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, _Fault):
            return path or "message", v.why
        if isinstance(v, str):
            fault = unicode_fault(v)
            if fault is not None:
                return path or "message", f"the string has a {fault}"
        elif isinstance(v, dict):
            children = []
            for k, child in v.items():
                name = f"{path}.{shown_key(k)}" if path else shown_key(k)
                fault = unicode_fault(k)
                if fault is not None:
                    return name, f"the key has a {fault}"
                children.append((name, child))
            stack.extend(reversed(children))
        elif isinstance(v, list):
            stack.extend(reversed([(f"{path}[{i}]", child) for i, child in enumerate(v)]))
    return None


def _diagnose(text: str):
    """(field, why, document) for the first value orjson cannot represent, or None."""
    try:
        document = json.loads(text, parse_int=_read_int, parse_float=_read_float, parse_constant=_read_constant)
    except (ValueError, RecursionError):  # not JSON at all (or too deep): orjson's reason stands
        return None
    fault = first_fault(document)
    return None if fault is None else (*fault, document)


def loads(text: str | bytes):
    """One JSON value. Raises RequestError (invalid_request) naming the field at fault, or `message` when the
    text is not JSON."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        reason = str(e)
    where = _diagnose(text) if isinstance(text, str) else None
    if where is not None:
        field, why, document = where
        raise UnrepresentableValue(f"{field}: {why}: decode.v1 reads JSON as orjson does (valid Unicode text, "
                                   f"integers in -2^63..2^64-1, finite doubles)", field=field, document=document)
    raise RequestError(f"malformed JSON ({reason}): each message must be one JSON object", field="message")


def dumps(frame: dict) -> str:
    """A frame as JSON text. Raises orjson.JSONEncodeError (a TypeError) for a value orjson cannot write."""
    return orjson.dumps(frame).decode()
