"""The Engine API's plain objects: a request in, events out. Nothing here holds a tensor, so the server
(which never imports torch) can build requests and read events.

Every accepted request ends with exactly one `Done` or `Error`.

A chat request (`ChatRequest`: messages, tools, tool_choice, thinking, reasoning_effort, response_format in
OpenAI's shapes) is built once at the API edge and encoded engine-side, as it is, in the checkpoint's own
prompt dialect (appliance.chat.encode_request); its `Tokens` events carry the answer (`text`), the reasoning
and whole tool calls apart, never markup. Here the fields are checked for shape only; what depends on the
dialect is checked when the engine encodes.

The limits below are the engine's; the HTTP APIs read their fields against the same numbers.
"""

from dataclasses import asdict, dataclass, field

from .errors import RequestError, shown, unicode_fault

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
TEMPERATURE = (0.0, 2.0)  # 0 = greedy
TOP_P = (0.0, 1.0)  # the low end open: top_p 0 would keep no token
TOP_K = (0, 100000)  # 0 = off
SEED_LIMIT = 2**63  # the sampler's generator takes seeds 0..2^63-1
MAX_STOPS = 16  # stop strings per request


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class Sampling:
    """None for temperature or top_p: the checkpoint's recommendation (its generation_config.json, else the
    model card's values), as the OpenAI and Anthropic APIs mean an omitted value."""

    temperature: float | None = 0.0  # 0 = greedy
    top_p: float | None = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def resolved(self, defaults: dict) -> "Sampling":
        """A copy with None fields taken from `defaults` (`temperature`, `top_p`)."""
        return Sampling(defaults["temperature"] if self.temperature is None else self.temperature,
                        defaults["top_p"] if self.top_p is None else self.top_p, self.top_k, self.seed)

    def validate(self) -> None:
        (t_lo, t_hi), (p_lo, p_hi), (k_lo, k_hi) = TEMPERATURE, TOP_P, TOP_K
        if self.temperature is not None and (not _number(self.temperature) or not t_lo <= self.temperature <= t_hi):
            raise RequestError(f"temperature={shown(self.temperature)}: must be a number in {t_lo:g}..{t_hi:g} "
                               "(0 = greedy)", field="sampling.temperature", value=self.temperature)
        if self.top_p is not None and (not _number(self.top_p) or not p_lo < self.top_p <= p_hi):
            raise RequestError(f"top_p={shown(self.top_p)}: must be a number in ({p_lo:g}, {p_hi:g}]",
                               field="sampling.top_p", value=self.top_p)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not k_lo <= self.top_k <= k_hi:
            raise RequestError(f"top_k={shown(self.top_k)}: must be an integer in {k_lo}..{k_hi} (0 = off)",
                               field="sampling.top_k", value=self.top_k)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise RequestError(f"seed={shown(self.seed)}: must be an integer in 0..2^63-1", field="sampling.seed",
                               value=self.seed)


@dataclass(frozen=True)
class ChatRequest:
    """A chat request as the chat encoder takes it (appliance.chat.encode_request), built once at the API edge,
    in OpenAI's shapes: messages [{role, content, ...}]; tools [{type: function, function: {name, description?,
    parameters?}}]; tool_choice auto | none | required | {type: function, function: {name}}; thinking None =
    the model's default (on); reasoning_effort as OpenAI's (none, minimal .. xhigh, max) or V4.1's 1..100;
    response_format {type: text | json_object | json_schema}.

    The values are the client's, unchecked: `validate` checks their shapes; their contents (roles in order,
    tool schemas, efforts) are the encoder's to check, against the checkpoint's dialect."""

    messages: list[dict] | None  # None: a decode.v1 frame that sent chat fields without them (refused)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    thinking: bool | None = None
    reasoning_effort: str | int | None = None
    response_format: dict | None = None

    @classmethod
    def from_body(cls, body) -> "ChatRequest":
        """The chat fields of an OpenAI chat-completions body, the thinking switch read from `thinking`, else
        `chat_template_kwargs.thinking`, else `.enable_thinking` (as vLLM and SGLang accept it): true, false or
        {"type": "enabled" | "disabled"}. Raises RequestError naming the field."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", field="body")
        return cls(body.get("messages"), body.get("tools"), body.get("tool_choice"), _thinking_switch(body),
                   body.get("reasoning_effort"), body.get("response_format"))

    def validate(self) -> None:
        if self.messages is not None:
            if not isinstance(self.messages, list) or not self.messages:
                raise RequestError("messages: must be a non-empty list of {role, content}", field="messages")
            for i, m in enumerate(self.messages):
                if not isinstance(m, dict):
                    raise RequestError(f"messages[{i}]: must be an object {{role, content}}", field=f"messages[{i}]")
                if m.get("role") not in CHAT_ROLES:
                    raise RequestError(f"messages[{i}].role={shown(m.get('role'))}: must be one of "
                                       f"{', '.join(CHAT_ROLES)}", field=f"messages[{i}].role", value=m.get("role"))
        for name, kind, what in _CHAT_SHAPES:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, kind) or (kind is bool) != isinstance(value, bool):
                raise RequestError(f"{name}={shown(value)}: must be {what}", field=name, value=value)
            if self.messages is None:
                raise RequestError(f"{name}: goes with messages (a chat request), not with prompt or input_ids",
                                   field=name)
        if self.messages is None:
            raise RequestError("messages: must be a non-empty list of {role, content}", field="messages")


_CHAT_SHAPES = (("tools", list, "a list of {type: function, function: {name, parameters}}"),
                ("tool_choice", str | dict, 'auto, none, required or {"type": "function", "function": {"name"}}'),
                ("thinking", bool, "true or false"),
                ("reasoning_effort", str | int, "none, minimal, low, medium, high, xhigh, max (V4.1: or 1..100)"),
                ("response_format", dict, "an object {type: text | json_object | json_schema}"))


def _thinking_switch(body: dict) -> bool | None:
    """The first thinking switch `body` gives; None when none is (the model's default: thinking on)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs: must be an object", field="chat_template_kwargs")
    kwargs = kwargs or {}
    for name, value in (("thinking", body.get("thinking")), ("chat_template_kwargs.thinking", kwargs.get("thinking")),
                        ("chat_template_kwargs.enable_thinking", kwargs.get("enable_thinking"))):
        if value is None:
            continue
        if isinstance(value, bool):
            return value
        if isinstance(value, dict) and value.get("type") in ("enabled", "disabled"):
            return value["type"] == "enabled"
        raise RequestError(f'{name}={shown(value)}: must be true, false or {{"type": "enabled" | "disabled"}}',
                           field=name, value=value)
    return None


@dataclass
class Request:
    """One generation. Exactly one of `input_ids`, `prompt` (text) or `chat` (messages) is set.
    `max_tokens` None: up to the context limit."""

    id: str = ""
    input_ids: list[int] | None = None
    prompt: str | None = None
    chat: ChatRequest | None = None
    max_tokens: int | None = 256
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    timings: str = "final"  # none | final | per_token

    def validate(self) -> None:
        if not isinstance(self.id, str):
            raise RequestError(f"id={shown(self.id)}: must be a string", field="id", value=self.id)
        messages = self.chat.messages if self.chat is not None else None
        given = [n for n, v in (("input_ids", self.input_ids), ("prompt", self.prompt), ("messages", messages))
                 if v is not None]
        if len(given) != 1:
            raise RequestError(f"give exactly one of input_ids, prompt, messages (got {', '.join(given) or 'none'})",
                               field="prompt")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise RequestError(f"max_tokens={shown(self.max_tokens)}: must be an integer of at least 1 (the prompt "
                               "plus max_tokens must fit the context)", field="max_tokens", value=self.max_tokens)
        if self.input_ids is not None:
            if not isinstance(self.input_ids, list) or not self.input_ids or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in self.input_ids):
                raise RequestError("input_ids: must be a non-empty list of integers", field="input_ids")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise RequestError("prompt: must be a non-empty string", field="prompt")
        if self.chat is not None:
            self.chat.validate()
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop) \
                or len(self.stop) > MAX_STOPS:
            raise RequestError(f"stop: must be a list of at most {MAX_STOPS} non-empty strings", field="stop")
        self._check_text()
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos={shown(self.ignore_eos)}: must be true or false", field="ignore_eos")
        if self.timings not in ("none", "final", "per_token"):
            raise RequestError(f"timings={shown(self.timings)}: must be none, final or per_token", field="timings")
        if not isinstance(self.sampling, Sampling):
            raise RequestError("sampling: must be an object", field="sampling")
        self.sampling.validate()

    def _check_text(self) -> None:
        """Every string the engine tokenizes or echoes must be valid Unicode. A lone surrogate fails inside the
        tokenizer, where it would count as an engine fault and reset the decode state (losing the cached
        prefix), or in the frame encoder; here it is the client's error, naming the field."""
        texts = [("id", self.id), ("prompt", self.prompt)]
        if self.chat is not None:
            texts += _strings(self.chat.messages, "messages") + _strings(self.chat.tools, "tools")
        texts += [(f"stop[{i}]", s) for i, s in enumerate(self.stop)]
        for name, text in texts:
            fault = unicode_fault(text) if isinstance(text, str) else None
            if fault is not None:
                raise RequestError(f"{name}: {fault}: text must be valid Unicode (send UTF-8, or escape a "
                                   f"character beyond U+FFFF as a surrogate pair)", field=name)


def _strings(value, path: str) -> list[tuple[str, str]]:
    """(field, text) of every string inside `value` (keys included), in document order; iterative, since a
    client may nest deeply."""
    out, stack = [], [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            out.append((where, v))
        elif isinstance(v, dict):
            named = [(f"{where}.{_printable(k)}", k, x) for k, x in v.items()]
            out += [(name, k) for name, k, _ in named if isinstance(k, str)]
            stack += reversed([(name, x) for name, _, x in named])
        elif isinstance(v, list):
            stack += reversed([(f"{where}[{i}]", x) for i, x in enumerate(v)])
    return out


def _printable(key) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")  # a field name must always encode


@dataclass
class Started:
    id: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Progress:
    id: str
    processed: int
    total: int
    ms: float


@dataclass
class Tokens:
    """Generated tokens. `text` is what they decode to; for a chat request it is the answer only (content),
    beside the `reasoning` and the `tool_calls` (whole calls, OpenAI's message shape) they completed. Text a
    marker may still begin is held back, so an event can carry ids and no text."""

    id: str
    ids: list[int]
    text: str
    index: int  # index of the first token in this event among the generated tokens
    t_ms: list[float]  # per token, ms since Started
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)


@dataclass
class Done:
    id: str
    finish_reason: str  # stop | length | cancelled
    usage: dict
    timings: dict
    speculative: dict | None = None
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason stop), None for EOS
    # how the prompt's prefix was restored: source (none | device | host | disk), matched_tokens (the longest
    # prefix any tier shares), cached_tokens (positions not prefilled), restored_bytes, restore_ms
    prefix_cache: dict | None = None


@dataclass
class Error:
    id: str
    code: str
    message: str
    param: str | None = None
    retryable: bool = False


def as_dict(event) -> dict:
    return {"type": type(event).__name__.lower(), **asdict(event)}
