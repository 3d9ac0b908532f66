"""Summaries of a probe run: per-metric statistics, SLO checks, the stdout table and the output files.

Percentiles interpolate linearly between order statistics (numpy's default), so p50 of [1, 2] is 1.5.
Inter-token gaps pool every gap of every measured request; the other metrics have one value per request.
"""

import csv
import math
from dataclasses import dataclass

import orjson

from appliance.errors import ApplianceError

from .client import ProbeRun

# name -> (unit, higher is better)
METRICS = {
    "ttft_ms": ("ms", False),
    "t2t_ms": ("ms", False),
    "server_ttft_ms": ("ms", False),
    "overhead_ms": ("ms", False),
    "tpot_ms": ("ms", False),
    "tokens_per_s": ("tok/s", True),
    "itl_ms": ("ms", False),
    "max_stall_ms": ("ms", False),
    "e2e_ms": ("ms", False),
    "prompt_tokens": ("tok", False),
    "output_tokens": ("tok", False),
    "accepted_length": ("tok", True),
}
STATS = ("n", "mean", "std", "min", "max", "p50", "p90", "p95", "p99")
PERCENTILES = (50, 90, 95, 99)
CSV_FIELDS = ("index", "prompt_tokens", "output_tokens", "finish_reason", "ttft_ms", "t2t_ms", "server_ttft_ms",
              "overhead_ms", "tpot_ms", "tokens_per_s", "max_stall_ms", "e2e_ms", "accepted_length",
              "delta_frames", "progress_frames")


def percentile(sorted_values: list[float], p: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    k = (len(sorted_values) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def describe(values: list[float]) -> dict:
    """n, mean, std (population), min, max, p50, p90, p95, p99; None for each but n when empty."""
    xs = sorted(float(v) for v in values if v is not None)
    out = {"n": len(xs)}
    if not xs:
        return out | {k: None for k in STATS[1:]}
    mean = sum(xs) / len(xs)
    out |= {"mean": mean, "std": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)), "min": xs[0],
            "max": xs[-1]}
    out |= {f"p{p}": percentile(xs, p) for p in PERCENTILES}
    return out


def summarize(run: ProbeRun) -> dict:
    recs = run.measured
    metrics = {}
    for name in METRICS:
        if name == "itl_ms":
            values = [g for r in recs for g in r.itl_ms]
        else:
            values = [getattr(r, name) for r in recs]
        metrics[name] = describe(values)
    reasons: dict[str, int] = {}
    for r in recs:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    gaps = "arrival" if any(r.gaps == "arrival" for r in recs) else "token"
    return {"metrics": metrics, "finish_reasons": reasons, "requests": len(recs), "warmup": run.config.warmup,
            "gaps": gaps}


# --- SLOs --------------------------------------------------------------------------------------------


@dataclass
class Slo:
    """`[stat_]metric=value`. stat: p50, p90, p95, p99, mean, min or max; without one, every request must
    meet it (max for latencies, min for rates such as tokens_per_s)."""

    key: str
    metric: str
    stat: str
    limit: float

    @property
    def higher_is_better(self) -> bool:
        return METRICS[self.metric][1]

    def check(self, metrics: dict) -> tuple[bool, float | None]:
        value = metrics[self.metric].get(self.stat)
        if value is None:
            return False, None
        return (value >= self.limit) if self.higher_is_better else (value <= self.limit), value


def parse_slo(text: str) -> list[Slo]:
    slos = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise ApplianceError(f"--slo {part}: must be NAME=VALUE, e.g. ttft_ms=500,tpot_ms=40,p99_itl_ms=80",
                                 field="slo")
        try:
            limit = float(value)
        except ValueError:
            raise ApplianceError(f"--slo {key}={value}: the value must be a number", field="slo") from None
        stat, metric = None, key
        head, _, rest = key.partition("_")
        if head in ("p50", "p90", "p95", "p99", "mean", "min", "max") and rest in METRICS:
            stat, metric = head, rest
        if metric not in METRICS:
            raise ApplianceError(f"--slo {key}: unknown metric; use one of {', '.join(METRICS)}, optionally "
                                 f"prefixed by p50_, p90_, p95_, p99_, mean_, min_ or max_", field="slo")
        if stat is None:
            stat = "min" if METRICS[metric][1] else "max"
        slos.append(Slo(key, metric, stat, limit))
    return slos


def check_slos(slos: list[Slo], summary: dict) -> list[dict]:
    results = []
    for s in slos:
        ok, value = s.check(summary["metrics"])
        results.append({"slo": s.key, "metric": s.metric, "stat": s.stat, "limit": s.limit, "value": value,
                        "ok": ok, "rule": ">=" if s.higher_is_better else "<="})
    return results


# --- output ------------------------------------------------------------------------------------------


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def table(run: ProbeRun, summary: dict) -> str:
    hello = run.hello
    cfg = run.config
    shape = f"prompt file, osl {cfg.osl}" if cfg.prompt is not None else f"isl {cfg.isl}, osl {cfg.osl}"
    lines = [f"probe {cfg.url}: model {hello.get('model')}, server {hello.get('server_version')}; "
             f"{summary['requests']} requests ({shape}) after {cfg.warmup} warm-up",
             f"{'metric':<16}{'unit':>6}" + "".join(f"{s:>10}" for s in STATS)]
    for name, (unit, _) in METRICS.items():
        row = summary["metrics"][name]
        lines.append(f"{name:<16}{unit:>6}" + "".join(f"{_fmt(row.get(s)):>10}" for s in STATS))
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(summary["finish_reasons"].items()))
    lines.append(f"finish reasons: {reasons or '-'}")
    if summary.get("gaps") == "arrival":
        lines.append("itl_ms, max_stall_ms: gaps between arrivals (the stream merged tokens into chunks), not "
                     "per token")
    return "\n".join(lines)


def write_json(path, run: ProbeRun, summary: dict, slo_results: list[dict]) -> None:
    doc = {"url": run.config.url, "hello": run.hello, "config": vars(run.config) | {"token": None},
           **summary, "slo": slo_results,
           "per_request": [r.as_dict(with_tokens=True) for r in run.measured]}
    with open(path, "wb") as f:
        f.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


def write_jsonl(path, run: ProbeRun) -> None:
    with open(path, "wb") as f:
        for r in run.records:
            f.write(orjson.dumps(r.as_dict()) + b"\n")


def write_csv(path, run: ProbeRun) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=("warmup",) + CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in run.records:
            w.writerow(r.as_dict(with_tokens=False))
