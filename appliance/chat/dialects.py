"""The three prompt dialects of the DeepSeek V4 family: their special tokens (strings and ids), DSML tag
names, reasoning-effort tables and the model card's sampling defaults. Facts only; the encoder
(`encoding.py`) and the output parser (`output.py`) read them from here.

| dialect            | checkpoints                              | what differs                                  |
|--------------------|------------------------------------------|-----------------------------------------------|
| `deepseek_v4`      | V4-Flash / V4-Pro, April preview         | effort: only "max" adds a text                |
| `deepseek_v4_0731` | V4-Flash-0731 (a V4 config with DSpark)  | effort table low / high / max                 |
| `deepseek_v41`     | V4.1-Flash, V4.1-Flash-1017              | `<｜System｜>`, spaced DSML names, effort 1-100 |

Source: shared/spec/chat-encoding.md §1 (ids), §2.5 (effort texts), §3 (V4.1), §5 (sampling).
"""

from dataclasses import dataclass, field

from appliance.errors import RequestError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"
TASKS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>", "domain": "<｜domain｜>",
         "title": "<｜title｜>", "read_url": "<｜read_url｜>"}
# V3-era tool tokens: still in the vocabulary, never written by V4/V4.1, never to be shown if a model emits one.
LEGACY_TOOL_TOKENS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                      "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                      "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>")

_V4_IDS = {BOS: 0, EOS: 1, PAD: 2, USER: 128803, ASSISTANT: 128804, THINK_OPEN: 128821, THINK_CLOSE: 128822,
           DSML: 128825, LATEST_REMINDER: 128828, TASKS["action"]: 128829, TASKS["query"]: 128830,
           TASKS["authority"]: 128831, TASKS["domain"]: 128832, TASKS["title"]: 128836,
           TASKS["read_url"]: 128845}
_V41_IDS = {**_V4_IDS, SYSTEM: 128799, IMAGE: 129264}

# The effort texts of §2.5, verbatim; each ends with a blank line. EFFORT_B's dash is U+2014.
EFFORT_A = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
EFFORT_B = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n")
# Per table: the encoder's effort value -> the text placed before message 0 (None is the encoder's default).
_EFFORT_TEXTS = {
    "april": {None: "", "high": "", "max": EFFORT_A},
    "0731": {None: "", "low": "", "high": EFFORT_A, "max": EFFORT_B},
}
_V41_LEVELS = {None: 75, "low": 50, "high": 75, "xhigh": 75, "max": 100}


@dataclass(frozen=True)
class Dialect:
    """One prompt dialect. `effort_table` is "april", "0731" or "numeric" (V4.1's 1-100)."""

    name: str
    family: str  # the model config's family (appliance.model.config)
    effort_table: str
    system_token: bool  # V4.1: `<｜System｜>` marks system text
    spaced_dsml: bool  # V4.1: ` calls`, ` invoke`, ` parameter`
    developer_role: bool  # V4 renders `developer`; the V4.1 reference refuses it
    special_tokens: dict[str, int] = field(repr=False)
    # Sampling recommended by the model card (§5): V4 and 0731 say temperature 1.0, top_p 1.0; no V4.1 card
    # line was found and every V4.1 host documents the same values.
    temperature: float = 1.0
    top_p: float = 1.0
    max_context: int = 1_048_576
    # "Think Max" needs at least 384K of context (model card, V4 family); None where no such rule is known.
    think_max_min_context: int | None = None

    @property
    def bos(self) -> str:
        return BOS

    @property
    def eos(self) -> str:
        return EOS

    @property
    def bos_id(self) -> int:
        return self.special_tokens[BOS]

    @property
    def eos_id(self) -> int:
        return self.special_tokens[EOS]

    def tag(self, name: str) -> str:
        """The DSML tag name as this dialect writes it: "tool_calls" / "invoke" / "parameter" in V4,
        " calls" / " invoke" / " parameter" in V4.1."""
        if not self.spaced_dsml:
            return name
        return " calls" if name == "tool_calls" else " " + name

    def effort_text(self, effort) -> str:
        """The text placed before message 0 in thinking mode for an encoder-level effort value (the
        reference tables; OpenAI's vocabulary is mapped onto them in request.py)."""
        if self.effort_table == "numeric":
            if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
                level = effort
            elif isinstance(effort, str | None) and effort in _V41_LEVELS:
                level = _V41_LEVELS[effort]
            else:
                raise RequestError(f"reasoning_effort={effort!r}: {self.name} takes low, high, max or an integer "
                                   "1..100", field="reasoning_effort", value=effort)
            return f"Reasoning Effort: {level} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
        table = _EFFORT_TEXTS[self.effort_table]
        if not isinstance(effort, str | None) or effort not in table:
            allowed = ", ".join(k for k in table if k)
            raise RequestError(f"reasoning_effort={effort!r}: {self.name} takes {allowed}", field="reasoning_effort",
                               value=effort)
        return table[effort]


DIALECTS = {
    "deepseek_v4": Dialect("deepseek_v4", "deepseek_v4", "april", system_token=False, spaced_dsml=False,
                           developer_role=True, special_tokens=_V4_IDS, think_max_min_context=393_216),
    "deepseek_v4_0731": Dialect("deepseek_v4_0731", "deepseek_v4", "0731", system_token=False, spaced_dsml=False,
                                developer_role=True, special_tokens=_V4_IDS, think_max_min_context=393_216),
    "deepseek_v41": Dialect("deepseek_v41", "deepseek_v41", "numeric", system_token=True, spaced_dsml=True,
                            developer_role=False, special_tokens=_V41_IDS),
}

# Strings the parser never shows although it gives them no meaning (EOS, the think tags and DSML it handles).
HIDDEN_TOKENS = (BOS, PAD, SYSTEM, USER, ASSISTANT, LATEST_REMINDER, IMAGE, *TASKS.values(), *LEGACY_TOOL_TOKENS)


def get_dialect(name: str) -> Dialect:
    try:
        return DIALECTS[name]
    except KeyError:
        raise RequestError(f"dialect {name!r}: must be one of {', '.join(DIALECTS)}", field="dialect",
                           value=name) from None


def dialect_for_model(family: str, has_dspark: bool) -> Dialect:
    """The dialect a checkpoint speaks: V4.1 by family; among V4 configs, the 0731 release is the one that
    carries a DSpark drafter (the April preview has the MTP head), which is also how third-party patches
    tell the two effort tables apart (§2.5)."""
    if family == "deepseek_v41":
        return DIALECTS["deepseek_v41"]
    if family == "deepseek_v4":
        return DIALECTS["deepseek_v4_0731" if has_dspark else "deepseek_v4"]
    raise RequestError(f"family {family!r}: no chat dialect (deepseek_v4 or deepseek_v41)", field="family",
                       value=family)
