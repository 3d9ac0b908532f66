"""An agent's conversation replayed through the Engine API (`appliance bench agent`): how much of each prompt
the prefix cache restores against what any earlier request shares, and what that does to the first token.

The synthetic conversation is a coding agent in thinking mode, encoded as the checkpoint's chat encoding
writes it (appliance/chat):
- a system prompt with tools (padded with a repository map to `context` tokens), and a task;
- each turn the model thinks (its output, whatever it is, becomes the turn's reasoning), then either calls
  a tool whose result comes back, or answers and the user follows up (turns alternate, so that twelve fit
  the embedded model's 4K context: its byte-level tokenizer spells each special token in ~10 ids); the
  client re-encodes the generated text, as a real client does, so the ids of the history need not be the
  ids the model emitted;
- every `side_every` turns a side request: a sub-agent sharing the system prompt (without the tools) in its
  own thinking-mode chat, whose earlier reasoning the encoding drops from its history (it has no tools).
The tool loop keeps its reasoning: the encoding drops reasoning only when no message carries tools.

A trace (JSONL, one request per line) replays real traffic instead; each line is one of
    {"input_ids": [...]}
    {"messages": [...], "tools": [...], "thinking": true}     (tools go on the first system message)
with optional "max_tokens" (default: the bench's) and "kind" (a label, e.g. "main" or "side").

Per request: prompt tokens, cached tokens (restored, not prefilled), the ideal (the longest prefix of the
prompt that an earlier request's prompt followed by its output shares, at most the prompt less its last
id), prefill time and TTFT.
"""

import json
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

from appliance.api import Done, Error, Request, Tokens
from appliance.chat import encode_messages
from appliance.errors import ApplianceError

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}}
    for name, desc in (("read", "Read a file"), ("test", "Run the tests matching an expression"))
]
TASK = "The nightly build fails in the parser: find the cause and fix it."


def _map_line(i: int) -> str:
    return f"src/pkg{i % 7}/module_{i}.py: class Module{i} (parse, render, validate); {40 + i * 7 % 300} lines\n"


class AgentConversation:
    """Builds each request of the synthetic conversation; `heard(kind, text)` adds the model's answer. Main
    turns alternate a tool call (its result comes back) and an answer the user follows up on."""

    def __init__(self, dialect, tokenizer, context: int = 0, side_every: int = 4):
        self.dialect, self.tokenizer, self.side_every = dialect, tokenizer, side_every
        doc = "You are a coding agent working in a Python repository."
        i = 0
        while len(self._ids([{"role": "system", "content": doc, "tools": TOOLS},
                             {"role": "user", "content": TASK}])) < context:
            doc += ("\nRepository map:\n" if i == 0 else "") + _map_line(i)
            i += 1
        self.main = [{"role": "system", "content": doc, "tools": TOOLS}, {"role": "user", "content": TASK}]
        self.side = [{"role": "system", "content": doc}]
        self.turn = 0

    def _ids(self, messages) -> list[int]:
        return self.tokenizer.encode(encode_messages(messages, self.dialect, thinking=True))

    def requests(self, turns: int) -> Iterator[tuple[str, list[int]]]:
        """(kind, prompt ids) for each request; call `heard` with each answer before asking for the next."""
        for t in range(1, turns + 1):
            self.turn = t
            yield "main", self._ids(self.main)
            if self.side_every and t % self.side_every == 0:
                self.side.append({"role": "user", "content": f"Summarize step {t} in one line."})
                yield "side", self._ids(self.side)

    def heard(self, kind: str, text: str) -> None:
        t = self.turn
        if kind == "side":
            self.side.append({"role": "assistant", "reasoning_content": text, "content": f"Step {t}: parser."})
        elif t % 2:
            call = {"id": f"c{t}", "type": "function",
                    "function": {"name": TOOLS[t // 2 % 2]["function"]["name"],
                                 "arguments": json.dumps({"arg": f"m{t}.py"})}}
            self.main += [{"role": "assistant", "reasoning_content": text, "content": "", "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": f"c{t}", "content": f"{t} passed, 1 failed"}]
        else:
            self.main += [{"role": "assistant", "reasoning_content": text, "content": f"Fixed step {t}."},
                          {"role": "user", "content": "Go on."}]


def read_trace(path: Path, dialect, tokenizer) -> list[dict]:
    """The requests of a JSONL trace: [{kind, ids, max_tokens}] (module docstring: the format)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"--trace {path}:{n}"
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ApplianceError(f"{where}: not JSON ({e})", field="trace") from None
        if not isinstance(r, dict):
            raise ApplianceError(f"{where}: must be an object with input_ids or messages", field="trace")
        if "input_ids" in r:
            ids = r["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                raise ApplianceError(f"{where}: input_ids must be a non-empty list of integers", field="trace")
        elif isinstance(r.get("messages"), list) and r["messages"]:
            messages = [dict(m) for m in r["messages"]]
            if r.get("tools"):
                if messages[0].get("role") != "system":
                    messages.insert(0, {"role": "system", "content": ""})
                messages[0]["tools"] = r["tools"]
            ids = tokenizer.encode(encode_messages(messages, dialect, thinking=bool(r.get("thinking", True))))
        else:
            raise ApplianceError(f"{where}: give input_ids or messages", field="trace")
        out.append({"kind": str(r.get("kind", "main")), "ids": ids, "max_tokens": r.get("max_tokens")})
    if not out:
        raise ApplianceError(f"--trace {path}: no requests", field="trace")
    return out


def _shared(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ask(generate: Callable, ids: list[int], max_tokens: int, rid: str) -> dict:
    """One request through the Engine API: its output ids and text, usage and timings."""
    out, text, done = [], [], None
    for event in generate(Request(id=rid, input_ids=ids, max_tokens=max_tokens, ignore_eos=True)):
        if isinstance(event, Tokens):
            out += event.ids
            text.append(event.text)
        elif isinstance(event, Error):
            raise ApplianceError(f"request {rid}: {event.message}", code=event.code, field=event.param)
        elif isinstance(event, Done):
            done = event
    return {"out": out, "text": "".join(text), "done": done}


def replay(generate: Callable, requests: Iterator[tuple[str, list[int], int]], heard=None) -> list[dict]:
    """Send each (kind, ids, max_tokens) in order; one row per request (module docstring)."""
    rows, seen = [], []
    for i, (kind, ids, max_tokens) in enumerate(requests):
        ideal = max((_shared(ids, s) for s in seen), default=0)
        r = ask(generate, ids, max_tokens, f"{kind}-{i}")
        done = r["done"]
        seen.append(ids + r["out"])
        if heard is not None:
            heard(kind, r["text"])
        rows.append({"request": i, "kind": kind, "prompt_tokens": len(ids),
                     "cached_tokens": done.usage["cached_tokens"], "ideal_cached_tokens": min(ideal, len(ids) - 1),
                     "prefill_ms": done.timings["prefill_ms"], "ttft_ms": done.timings["ttft_ms"],
                     "restored_from": (done.prefix_cache or {}).get("source"), "output": r["out"]})
    return rows


def summary(rows: list[dict]) -> dict:
    """Totals, and how TTFT grows with the prompt over the late half of the main requests (ms per 1K prompt
    tokens, least squares)."""
    cached = sum(r["cached_tokens"] for r in rows)
    ideal = sum(r["ideal_cached_tokens"] for r in rows)
    main = [r for r in rows if r["kind"] == "main"]
    late = main[len(main) // 2:]
    slope = None
    if len(late) >= 2 and len({r["prompt_tokens"] for r in late}) > 1:
        xs, ys = [r["prompt_tokens"] / 1e3 for r in late], [r["ttft_ms"] for r in late]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"requests": len(rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows), "cached_tokens": cached,
            "ideal_cached_tokens": ideal, "cached_of_ideal": cached / ideal if ideal else 1.0,
            "late_main_ttft_ms": statistics.mean(r["ttft_ms"] for r in late) if late else None,
            "late_main_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in late) if late else None,
            "late_main_prefilled_tokens": statistics.mean(r["prompt_tokens"] - r["cached_tokens"] for r in late)
            if late else None,
            "late_ttft_ms_per_1k_prompt_tokens": slope}
