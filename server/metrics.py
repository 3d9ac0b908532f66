"""Prometheus metrics (`GET /metrics`), all named `decode_*`, in a registry of their own (so two servers in
one process, as in tests, never collide). Latencies are in seconds with buckets from 0.5 ms: a decode
step on the target box is a few milliseconds, and a bucket floor above that would hide it."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from appliance.api import Done, Error

# 0.5 ms .. 10 min: decode steps at the bottom, long prefills at the top.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ACCEPTED_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 12.0, 16.0)
FINISH_REASONS = ("stop", "length", "cancelled", "error")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.ttft = hist("decode_ttft_seconds", "Time to first token on the server (engine queue included)")
        self.itl = hist("decode_inter_token_seconds", "Gap between consecutive generated tokens")
        self.tpot = hist("decode_tpot_seconds", "Mean time per output token of a request, first token excluded")
        self.e2e = hist("decode_e2e_seconds", "Request time from engine submit to done")
        self.prefill = hist("decode_prefill_seconds", "Prefill time of a request")
        self.accepted = hist("decode_accepted_length", "Draft tokens accepted per speculative decode cycle "
                             "(the target's own token not counted; as done.speculative.mean_accepted)",
                             ACCEPTED_BUCKETS)
        self.prompt_tokens = Counter("decode_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("decode_cached_prompt_tokens", "Prompt tokens restored instead of prefilled "
                                     "(the live state or the prefix cache)", registry=r)
        self.cache_hits = Counter("decode_prefix_cache_hits", "Requests that restored a cached prefix, by where "
                                  "its rows came from (device: the live state; host; disk)", ["tier"], registry=r)
        self.cache_misses = Counter("decode_prefix_cache_misses", "Requests prefilled from position 0",
                                    registry=r)
        self.cache_bytes = Counter("decode_prefix_cache_restored_bytes", "Bytes copied into the decode state "
                                   "by restores (rows, ids, checkpoints)", registry=r)
        self.cache_restore = hist("decode_prefix_cache_restore_seconds", "Time to restore a cached prefix "
                                  "(files read included)")
        for tier in ("device", "host", "disk"):
            self.cache_hits.labels(tier)
        self.disk_errors = Counter("decode_prefix_cache_disk_errors", "Failed operations of the prefix cache's "
                                   "disk tier by kind (read, write, evict, scan): each a notice in the log; the "
                                   "request ends as it would have", ["op"], registry=r)
        self._disk_seen: dict[str, int] = {}
        self.generated_tokens = Counter("decode_generated_tokens", "Generated tokens", registry=r)
        self.requests = Counter("decode_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.errors = Counter("decode_errors", "Error frames sent, by error code", ["code"], registry=r)
        self.busy = Counter("decode_busy_rejections", "Connections or generates refused because the box was busy",
                            registry=r)
        self.connections = Gauge("decode_connections", "Open websocket connections", registry=r)
        self.queued = Gauge("decode_queued_connections", "Connections waiting for the box (--on-busy queue)",
                            registry=r)
        self.running = Gauge("decode_running_requests", "Requests submitted to the engine and not yet ended (one "
                             "runs; with --on-busy queue the next may wait behind a cancelled one)", registry=r)
        self.dropped = Counter("decode_dropped_connections", "Connections the server dropped or refused for what "
                               "the client did, by reason (over_cap: past --max-connections; slow_body: a body "
                               "that did not arrive in time; slow_reader: a client that stopped reading)",
                               ["reason"], registry=r)
        for reason in ("over_cap", "slow_body", "slow_reader"):
            self.dropped.labels(reason)
        self.ready = Gauge("decode_ready", "1 once the engine is loaded and warmed up", registry=r)
        self.heartbeat_age = Gauge("decode_engine_heartbeat_age_seconds", "Seconds since the engine thread last "
                                   "made progress", registry=r)
        for reason in FINISH_REASONS:  # export zeros so rates work from the first scrape
            self.requests.labels(reason)

    def observe_tokens(self, gaps_ms: list[float]) -> None:
        for g in gaps_ms:
            self.itl.observe(g / 1e3)

    def observe_end(self, event) -> None:
        """A request's terminal event (Done or Error)."""
        if isinstance(event, Error):
            self.requests.labels("error").inc()  # its error frame is counted in `errors` when sent
            return
        assert isinstance(event, Done)
        self.requests.labels(event.finish_reason).inc()
        t = event.timings
        queue = (t.get("queue_ms") or 0.0) / 1e3
        if t.get("ttft_ms") is not None:
            self.ttft.observe(queue + t["ttft_ms"] / 1e3)
        if t.get("tpot_ms") is not None:
            self.tpot.observe(t["tpot_ms"] / 1e3)
        if t.get("prefill_ms") is not None:
            self.prefill.observe(t["prefill_ms"] / 1e3)
        if t.get("e2e_ms") is not None:
            self.e2e.observe(queue + t["e2e_ms"] / 1e3)
        u = event.usage
        self.prompt_tokens.inc(u.get("prompt_tokens", 0))
        self.cached_tokens.inc(u.get("cached_tokens", 0))
        self.generated_tokens.inc(u.get("completion_tokens", 0))
        self.observe_prefix_cache(event.prefix_cache)
        spec = event.speculative or {}
        histogram = spec.get("acceptance_histogram")  # cycles by number of accepted drafts
        if histogram:
            for accepted, cycles in enumerate(histogram):
                for _ in range(int(cycles)):
                    self.accepted.observe(accepted)
        elif spec.get("mean_accepted") is not None:
            self.accepted.observe(spec["mean_accepted"])

    def observe_prefix_cache(self, info: dict | None) -> None:
        """Done.prefix_cache: where the request's prefix came from, how many bytes, how long."""
        if not info:
            return
        if info.get("cached_tokens", 0) > 0 and info.get("source") in ("device", "host", "disk"):
            self.cache_hits.labels(info["source"]).inc()
        else:
            self.cache_misses.inc()
        self.cache_bytes.inc(info.get("restored_bytes", 0))
        if info.get("restore_ms") is not None:
            self.cache_restore.observe(info["restore_ms"] / 1e3)

    def engine_stats(self, stats: dict) -> None:
        """Bring the counters the engine keeps (Engine.stats) up to date, at a scrape."""
        for op, n in stats.get("prefix_cache_disk_errors", {}).items():
            self.disk_errors.labels(op).inc(max(0, n - self._disk_seen.get(op, 0)))
            self._disk_seen[op] = n

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
