"""Reading the fields of an HTTP API body (OpenAI's or Anthropic's), without I/O: each reader returns the
value (None when absent or null) or raises RequestError naming the parameter and what it must be. Fields a
reader is not asked about are ignored, as OpenAI and other servers ignore unknown fields."""

from appliance.api import MAX_STOPS, SEED_LIMIT
from appliance.errors import RequestError, shown


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def body_object(body) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    return body


def integer(body: dict, name: str, lo: int, hi: int | None = None, what: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f"at least {lo}"
        raise RequestError(f"{name}={shown(value)}: must be an integer {bound}{what}", field=name, value=value)
    return value


def number(body: dict, name: str, lo: float, hi: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value) or not (lo < value if low_open else lo <= value) or value > hi:
        bound = f"({lo:g}, {hi:g}]" if low_open else f"{lo:g}..{hi:g}"
        raise RequestError(f"{name}={shown(value)}: must be a number in {bound}", field=name, value=value)
    return float(value)


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name}={shown(value)}: must be true or false", field=name, value=value)
    return value


def obj(body: dict, name: str) -> dict:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{name}={shown(value)}: must be an object", field=name, value=value)
    return value


def stop_list(body: dict, name: str) -> list[str]:
    """A stop string or a list of them (at most MAX_STOPS, none empty)."""
    value = body.get(name)
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"{name}={shown(value)}: must be a non-empty string or a list of at most {MAX_STOPS} of "
                           "them", field=name, value=value)
    return stops


def unsupported(body: dict, name: str, neutral: tuple, why: str) -> None:
    """A known parameter this server cannot honour: accepted at its neutral values, else a 400 naming it."""
    value = body.get(name)
    if value is not None and value not in neutral:
        raise RequestError(f"{name}={shown(value)}: not supported: {why}", field=name, value=value)


def seed(body: dict) -> int | None:
    """Any 64-bit integer; the engine's generator takes 0..SEED_LIMIT-1, so a negative seed is folded into it."""
    value = body.get("seed")
    if value is None:
        return None
    if not _is_int(value) or not -(2**63) <= value < 2**64:
        raise RequestError(f"seed={shown(value)}: must be a 64-bit integer", field="seed", value=value)
    return value % SEED_LIMIT
