"""The server's Prometheus series, in a registry of their own (several servers may share a process in tests)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..generation.outputs import FINISH_REASONS, StreamEvent

PREFIX = "sparseserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """Per-request latencies and counts (observed when a request finishes, from the engine's own
    clock) and engine gauges (refreshed by the engine thread while it is busy)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tbt = Histogram(
            f"{PREFIX}_time_between_tokens_seconds",
            "Gap between consecutive tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queueing = Histogram(
            f"{PREFIX}_queueing_delay_seconds", "Arrival to admission", buckets=LATENCY_BUCKETS, registry=r
        )
        self.generated = Counter(f"{PREFIX}_generated_tokens", "Tokens generated", registry=r)
        self.prompt = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter(
            f"{PREFIX}_rejected_requests", "Requests answered with an error, by HTTP status", ["status"], registry=r
        )
        self.running = Gauge(
            f"{PREFIX}_requests_running", "Requests that produced a token and have not finished", registry=r
        )
        self.waiting = Gauge(f"{PREFIX}_requests_waiting", "Requests accepted that have no token yet", registry=r)
        self.hit_rate = Gauge(f"{PREFIX}_hbm_cache_hit_rate", "HBM block-cache hits / lookups so far", registry=r)
        self.hbm_bytes = Gauge(f"{PREFIX}_hbm_kv_bytes", "Device bytes of KV in use", registry=r)
        self.dram_bytes = Gauge(f"{PREFIX}_dram_kv_bytes", "Host bytes of KV blocks in use", registry=r)
        self.loaded = Gauge(
            f"{PREFIX}_loaded_tokens_per_kv_head",
            "KV tokens a sparse decode step reads per KV head and request (loaded blocks + tail), average so far",
            registry=r,
        )
        self.loaded_fraction = Gauge(
            f"{PREFIX}_loaded_fraction", "KV tokens read by sparse decode / tokens in the cache, so far", registry=r
        )
        self.sat_out = Gauge(f"{PREFIX}_admission_sit_outs", "Decode slots that sat out an iteration (working-set admission), so far", registry=r)  # fmt: skip
        for reason in FINISH_REASONS:
            self.requests.labels(reason)  # every series exists from the start (scrapers see zeros)

    def finished(self, event: StreamEvent, times: dict[str, Any]) -> None:
        """A request ended (engine thread): its latencies and counts."""
        output = event.output
        self.requests.labels(output.finish_reason).inc()
        self.generated.inc(len(output.token_ids))
        self.prompt.inc(len(output.prompt_token_ids))
        if times.get("ttft_s") is not None:
            self.ttft.observe(times["ttft_s"])
        if times.get("queueing_delay_s") is not None:
            self.queueing.observe(times["queueing_delay_s"])
        for gap in times.get("tbt_s") or ():
            self.tbt.observe(gap)

    def engine_totals(self, totals: dict[str, Any]) -> None:
        """The Generator's engine-wide figures (engine thread)."""
        self.hit_rate.set(totals.get("hit_rate") or 0.0)
        self.hbm_bytes.set(totals.get("hbm_bytes_in_use") or 0)
        self.dram_bytes.set(totals.get("dram_bytes_in_use") or 0)
        self.sat_out.set(totals.get("sat_out") or 0)
        self.loaded.set(totals.get("loaded_tokens_per_kv_head") or 0.0)
        self.loaded_fraction.set(totals.get("loaded_fraction") or 0.0)

    def exposition(self) -> bytes:
        """Every series in Prometheus' text format (what GET /metrics returns)."""
        return generate_latest(self.registry)
