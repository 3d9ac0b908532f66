"""Errors a person can act on: each carries a code, the field at fault, the offending value, and a message
that names the field and the fix. The server maps `code` to a protocol error in one place."""


class ApplianceError(Exception):
    """Base error. `code` is one of the protocol's error codes (`invalid_request`,
    `context_length_exceeded`, `internal`, ...) or a load-time code (`invalid_model`)."""

    code = "internal"

    def __init__(self, message: str, *, field: str | None = None, value=None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.value = value
        if code is not None:
            self.code = code


class ModelLoadError(ApplianceError):
    """A model directory, config or checkpoint that cannot be served as it is."""

    code = "invalid_model"


class ConfigError(ModelLoadError):
    def __init__(self, path, field: str, message: str, value=None):
        super().__init__(f"{path}: {field}: {message}", field=field, value=value)
        self.path = path


class WeightsError(ModelLoadError):
    pass


class RequestError(ApplianceError):
    code = "invalid_request"


class ContextLengthError(RequestError):
    code = "context_length_exceeded"


class MemoryPlanError(ModelLoadError):
    code = "memory_plan"


class RankDivergence(ApplianceError):
    """Two ranks did not do the same thing (a defect, never a client's fault): found where the ranks compare
    their plans (decode/plan.py) or, with --check-ranks, their calls before a collective
    (parallel/collectives.py); raised on every rank at the same point, so every rank ends the request and
    resets its live state, where the transport would have aborted or hung."""


class StateError(ApplianceError):
    """A decode-state operation that its capacity cannot honour (e.g. rewinding past the ring)."""


def shown(value, limit: int = 60) -> str:
    """`value` as an error message may quote it: the repr of a number, string or flag (cut at `limit`
    characters), and only the kind and size of an array or object. A client's value can be a 20 MB list or
    nested 1,000 deep (repr then raises RecursionError), and a message must stay short and always build."""
    if isinstance(value, list):
        return f"[...] (an array of {len(value)} items)"
    if isinstance(value, dict):
        return f"{{...}} (an object of {len(value)} keys)"
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    text = repr(value)  # str: repr escapes lone surrogates and control characters, so the message stays valid
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def unicode_fault(text: str) -> str | None:
    """Why `text` is not valid Unicode (a lone surrogate, e.g. from the JSON escape "\\ud800"), or None. Such a
    string cannot be encoded as UTF-8: neither a tokenizer nor a frame encoder can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"lone surrogate {text[e.start]!r} at character {e.start}"
    return None
