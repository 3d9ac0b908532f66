"""The Engine API's plain objects: a request in, events out. Nothing here holds a tensor, so the server
(which never imports torch) can build requests and read events.

Every accepted request ends with exactly one `Done` or `Error`.
"""

from dataclasses import asdict, dataclass, field

from .errors import RequestError, shown, unicode_fault

MAX_TOKENS_LIMIT = 8192


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0.0 <= self.temperature <= 2.0:
            raise RequestError(f"temperature={shown(self.temperature)}: must be a number in 0..2 (0 = greedy)",
                               field="sampling.temperature", value=self.temperature)
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p={shown(self.top_p)}: must be a number in (0, 1]", field="sampling.top_p",
                               value=self.top_p)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k <= 100000:
            raise RequestError(f"top_k={shown(self.top_k)}: must be an integer in 0..100000 (0 = off)",
                               field="sampling.top_k", value=self.top_k)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed={shown(self.seed)}: must be an integer in 0..2^63-1", field="sampling.seed",
                               value=self.seed)


@dataclass
class Request:
    """One generation. Exactly one of `input_ids`, `prompt` (text) or `messages` (chat) is set."""

    id: str = ""
    input_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    timings: str = "final"  # none | final | per_token

    def validate(self) -> None:
        if not isinstance(self.id, str):
            raise RequestError(f"id={shown(self.id)}: must be a string", field="id", value=self.id)
        given = [n for n in ("input_ids", "prompt", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise RequestError(f"give exactly one of input_ids, prompt, messages (got {', '.join(given) or 'none'})",
                               field="prompt")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise RequestError(f"max_tokens={shown(self.max_tokens)}: must be an integer in 1..{MAX_TOKENS_LIMIT}",
                               field="max_tokens", value=self.max_tokens)
        if self.input_ids is not None:
            if not isinstance(self.input_ids, list) or not self.input_ids or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in self.input_ids):
                raise RequestError("input_ids: must be a non-empty list of integers", field="input_ids")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise RequestError("prompt: must be a non-empty string", field="prompt")
        if self.messages is not None:
            if not isinstance(self.messages, list) or not self.messages or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str)
                    and m.get("role") in ("system", "user", "assistant") for m in self.messages):
                raise RequestError("messages: must be a non-empty list of {role: system|user|assistant, content: str}",
                                   field="messages")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop) \
                or len(self.stop) > 16:
            raise RequestError("stop: must be a list of at most 16 non-empty strings", field="stop")
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
        texts += [(f"messages[{i}].content", m["content"]) for i, m in enumerate(self.messages or [])]
        texts += [(f"stop[{i}]", s) for i, s in enumerate(self.stop)]
        for name, text in texts:
            fault = unicode_fault(text) if isinstance(text, str) else None
            if fault is not None:
                raise RequestError(f"{name}: {fault}: text must be valid Unicode (send UTF-8, or escape a "
                                   f"character beyond U+FFFF as a surrogate pair)", field=name)


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
    id: str
    ids: list[int]
    text: str
    index: int  # index of the first token in this event among the generated tokens
    t_ms: list[float]  # per token, ms since Started


@dataclass
class Done:
    id: str
    finish_reason: str  # stop | length | cancelled
    usage: dict
    timings: dict
    speculative: dict | None = None
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
