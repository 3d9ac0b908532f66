"""What happens before a request is served, without I/O: which path and method are asked for, whether the
caller holds the token, whether a browser origin is allowed. Every refusal is an HTTP answer (`Verdict`),
never an exception: a header sent twice where one is read is 400, a method the path does not answer is 405
with `Allow`. Headers are a multidict (aiohttp's `request.headers`: `getall`).

Auth is on when a token is configured. Scripts send `Authorization: Bearer <token>` (Anthropic's SDKs may
send `x-api-key: <token>` instead, accepted alike); browsers, which cannot set headers on a websocket, offer
the subprotocol `bearer.<base64url token>` next to `decode.v1` (the server never selects it, so it is not
echoed back). Tokens are compared as bytes in constant time (equal-length digests, `hmac.compare_digest`):
a credential that is not even UTF-8 is just another wrong token. They are never accepted in the URL.

Browsers: a request with an `Origin` (every cross-origin fetch, and a websocket from a page) is served only
when --origin allows that origin (`*` allows any); otherwise 403, and an Origin sent twice is 400. The API
routes answer an allowed origin's CORS preflight (OPTIONS) and put `Access-Control-Allow-Origin` on their
replies; their POST bodies must be `application/json` (415 otherwise), so a page cannot send one as a
"simple" text/plain request that skips the preflight.
"""

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

from appliance.errors import ApplianceError

from .protocol import PATH, PROTOCOL

HTTP_ROUTES = ("/healthz", "/readyz", "/metrics")
HTTP_METHODS = ("GET", "HEAD")  # HEAD: the GET answer's status and headers, no body
UPGRADE_METHODS = ("GET",)  # RFC 6455: the opening handshake is a GET
# The OpenAI- and Anthropic-compatible routes (server/openai_api.py, server/anthropic_api.py) and their methods.
API_ROUTES = {"/v1/models": HTTP_METHODS, "/v1/models/{id}": HTTP_METHODS, "/v1/chat/completions": ("POST",),
              "/v1/completions": ("POST",), "/v1/responses": ("POST",), "/v1/messages": ("POST",),
              "/v1/messages/count_tokens": ("POST",)}
API_PREFIX = "/v1/"  # every other path under it is an API 404, in the API's error shape
BEARER_PREFIX = "bearer."
CORS_HEADERS = "authorization, content-type, x-api-key, anthropic-version, anthropic-beta, openai-organization, " \
               "openai-project, x-stainless-lang, x-stainless-package-version, x-stainless-os, x-stainless-arch, " \
               "x-stainless-runtime, x-stainless-runtime-version, x-stainless-retry-count, x-stainless-timeout"


class BadHeader(ValueError):
    """A request header this server cannot read as one value (sent more than once)."""

    def __init__(self, name: str, count: int):
        super().__init__(f"the {name} header is sent {count} times: send it once")
        self.name = name


def one_header(headers, name: str) -> str | None:
    """The header's one value, None when absent. Raises BadHeader when it is repeated: which of two tokens
    or origins counts is not for the server to guess."""
    values = headers.getall(name, [])
    if len(values) > 1:
        raise BadHeader(name, len(values))
    return values[0] if values else None


def api_route(path: str) -> str | None:
    """The API route `path` asks for (`/v1/models/{id}` for a model's own path), None when it is none."""
    if path in API_ROUTES:
        return path
    if path.startswith("/v1/models/") and len(path) > len("/v1/models/") and "/" not in path[len("/v1/models/"):]:
        return "/v1/models/{id}"
    return None


def split_target(target: str) -> tuple[str, str]:
    """(path, query) of a request target, without urllib's URL parsing (which raises on `//[`)."""
    path, _, query = target.partition("?")
    return path, query


def read_token(path) -> str:
    """The token in `path` (surrounding whitespace stripped). Refuses an empty file."""
    p = Path(path)
    try:
        token = p.read_text().strip()
    except OSError as e:
        raise ApplianceError(f"--token-file {p}: cannot read it ({e.strerror})", field="token_file") from None
    if not token:
        raise ApplianceError(f"--token-file {p}: is empty; put the token on one line", field="token_file")
    if any(c.isspace() for c in token):
        raise ApplianceError(f"--token-file {p}: the token contains whitespace; use one word (e.g. "
                             f"`openssl rand -hex 32`)", field="token_file")
    return token


def offered_subprotocols(headers) -> list[str]:
    return [p.strip() for value in headers.getall("Sec-WebSocket-Protocol", []) for p in value.split(",")
            if p.strip()]


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def token_matches(candidate: bytes, token: str) -> bool:
    # Digests first, so the compare takes the same time whatever the candidate's length.
    return hmac.compare_digest(_digest(candidate), _digest(token.encode()))


def bearer_from_subprotocol(protocol: str) -> bytes | None:
    if not protocol.startswith(BEARER_PREFIX):
        return None
    raw = protocol[len(BEARER_PREFIX):]
    try:
        return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
    except (binascii.Error, ValueError):
        return None


def _raw(value: str) -> bytes:
    """A header value as the bytes the client sent (aiohttp decodes them as UTF-8 with surrogateescape)."""
    return value.encode("utf-8", "surrogateescape")


def authorized(headers, token: str | None) -> bool:
    """True when no token is configured, or the request carries it (Authorization, x-api-key or subprotocol).
    Raises BadHeader for a repeated Authorization or x-api-key header."""
    if token is None:
        return True
    ok = False
    auth = one_header(headers, "Authorization")
    if auth is not None:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer":
            ok |= token_matches(_raw(value.strip()), token)
    api_key = one_header(headers, "x-api-key")
    if api_key is not None:
        ok |= token_matches(_raw(api_key.strip()), token)
    for proto in offered_subprotocols(headers):
        candidate = bearer_from_subprotocol(proto)
        if candidate is not None:
            ok |= token_matches(candidate, token)
    return ok


def origin_allowed(origin: str | None, allowed: tuple[str, ...]) -> bool:
    """Requests without an Origin header (scripts, the probe) pass; a browser's origin must be listed
    (`*` lists every origin). With no --origin at all, browsers are refused."""
    if origin is None:
        return True
    return "*" in allowed or origin.rstrip("/") in {a.rstrip("/") for a in allowed}


def select_subprotocol(offered) -> str | None:
    """decode.v1 when offered; a client that offers nothing still connects (plain tools)."""
    return PROTOCOL if PROTOCOL in offered else None


@dataclass(frozen=True)
class Verdict:
    """An HTTP answer instead of the upgrade (`status`, `text`), or None fields to go on with it. `allow`:
    the methods a 405 names; `content_type`: when not plain text; `headers`: more (a preflight's)."""

    status: int | None = None
    text: str = ""
    www_authenticate: bool = False
    allow: tuple[str, ...] = ()
    content_type: str | None = None
    headers: tuple[tuple[str, str], ...] = ()


UNAUTHORIZED = Verdict(401, "unauthorized: send `Authorization: Bearer <token>` (the server's --token-file) or "
                            "offer the subprotocol bearer.<base64url token>\n", www_authenticate=True)


def check_method(method: str, path: str) -> Verdict:
    """405 for a method the path does not answer; an unknown path is left to its 404."""
    route = api_route(path)
    allowed = HTTP_METHODS if path in HTTP_ROUTES else UPGRADE_METHODS if path == PATH else API_ROUTES.get(route)
    if allowed is None or method in allowed:
        return Verdict()
    return Verdict(405, f"method {method[:32]} is not allowed on {path}: use {' or '.join(allowed)}\n",
                   allow=allowed)


def check_origin(headers, origins: tuple[str, ...]) -> Verdict:
    """400 for an Origin sent twice, 403 for a browser origin --origin does not allow."""
    try:
        origin = one_header(headers, "Origin")
    except BadHeader as e:
        return Verdict(400, f"{e}\n")
    if not origin_allowed(origin, origins):
        return Verdict(403, f"origin {origin[:200]} is not allowed: start the server with --origin {origin[:200]}\n")
    return Verdict()


def cors(headers, origins: tuple[str, ...]) -> dict[str, str]:
    """The CORS headers of a reply to an allowed browser origin (none without an Origin, or for one that is
    refused or repeated)."""
    origin = headers.get("Origin")
    if origin is None or check_origin(headers, origins).status is not None:
        return {}
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
            "Access-Control-Expose-Headers": "Retry-After, WWW-Authenticate"}


def preflight(headers, route: str, origins: tuple[str, ...]) -> Verdict:
    """The answer to a browser's CORS preflight (OPTIONS) of an API route: 204 with what it may send, or the
    origin's refusal."""
    refused = check_origin(headers, origins)
    if refused.status is not None:
        return refused
    if headers.get("Origin") is None:
        return Verdict(204, allow=(*API_ROUTES[route], "OPTIONS"))
    allow = (("Access-Control-Allow-Methods", ", ".join((*API_ROUTES[route], "OPTIONS"))),
             ("Access-Control-Allow-Headers", CORS_HEADERS), ("Access-Control-Max-Age", "600"))
    return Verdict(204, headers=tuple(cors(headers, origins).items()) + allow)


def check_content_type(headers) -> Verdict:
    """415 for a body that says it is not JSON (a missing Content-Type is taken as JSON: scripts)."""
    try:
        value = one_header(headers, "Content-Type")
    except BadHeader as e:
        return Verdict(400, f"{e}\n")
    if value is None:
        return Verdict()
    kind = value.split(";", 1)[0].strip().lower()
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return Verdict()
    return Verdict(415, f"Content-Type {value[:100]}: the body must be JSON (send Content-Type: application/json)\n")


def check_token(headers, token: str | None) -> Verdict:
    """401 without the token (when one is configured), 400 for a repeated Authorization header."""
    try:
        return Verdict() if authorized(headers, token) else UNAUTHORIZED
    except BadHeader as e:
        return Verdict(400, f"{e}\n")


def token_in_url(query: str) -> Verdict:
    """400 for a token in the query string (it would land in logs and browser history)."""
    if any(k.lower() in ("token", "access_token", "bearer", "api_key", "key") for k in parse_qs(query)):
        return Verdict(400, "tokens never go in the URL: send `Authorization: Bearer <token>` or offer the "
                            "subprotocol bearer.<base64url token>\n")
    return Verdict()


def check_upgrade(target: str, headers, token: str | None, origins: tuple[str, ...]) -> Verdict:
    """Decide a request for the websocket path (everything that is not one of HTTP_ROUTES)."""
    path, query = split_target(target)
    if path != PATH:
        return Verdict(404, f"no such path {path[:200]}: the websocket is at {PATH}; also /healthz, /readyz, "
                            f"/metrics, {', '.join(API_ROUTES)}\n")
    for verdict in (token_in_url(query), check_origin(headers, origins)):
        if verdict.status is not None:
            return verdict
    return check_token(headers, token)
