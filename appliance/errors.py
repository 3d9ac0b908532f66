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


class StateError(ApplianceError):
    """A decode-state operation that its capacity cannot honour (e.g. rewinding past the ring)."""
