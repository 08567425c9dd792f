"""Prometheus metrics with vLLM's and TGI's names, so existing dashboards and autoscalers work unchanged.

The only module that imports prometheus_client. Every server instance owns its own registry (tests run
several in one process). Engine-wide values (queue depth, KV usage, cumulative token counters) are read
from the engine's latest SchedulerStats at scrape time; per-request histograms are observed by the API
layer when a request finishes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector

from server.core.outputs import ITERATION_TOKEN_BUCKETS, SchedulerStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM and TGI expose no *_created series; they would double the scrape size for nothing.
disable_created_metrics()


@dataclass(frozen=True)
class FinishedRequestTimes:
    """What the API layer measured for one finished request (seconds, from time.monotonic())."""

    finished_reason: str  # vLLM's label value: stop, length, abort, error
    num_prompt_tokens: int
    num_generation_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    inter_token_latencies: tuple[float, ...]


# TGI's request counters, named as TGI's exporter names them (no `_total`).
TGI_COUNTERS = ("tgi_request_count", "tgi_request_success", "tgi_request_failure")


class _EngineCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        stats = m.stats_source()
        name = m.model_name
        counts = m.snapshot_counts()

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        running = float(stats.num_running) if stats else 0.0
        waiting = float(stats.num_waiting) if stats else 0.0
        usage = float(stats.kv_cache_usage) if stats else 0.0
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "Deprecated alias of vllm:kv_cache_usage_perc.", usage)
        yield counter(
            "vllm:prompt_tokens",
            "Prompt tokens computed (prefix cache hits excluded).",
            float(stats.num_prompt_tokens) if stats else 0.0,
        )
        yield counter(
            "vllm:generation_tokens",
            "Generated tokens.",
            float(stats.num_generation_tokens) if stats else 0.0,
        )
        yield counter("vllm:num_preemptions", "Preemptions.", float(stats.num_preemptions) if stats else 0.0)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            float(stats.prefix_cache_queries) if stats else 0.0,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            float(stats.prefix_cache_hits) if stats else 0.0,
        )
        buckets, steps, tokens = stats.iteration_tokens if stats else ((), 0, 0)
        iteration = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Number of tokens per engine_step.", labels=["model_name"]
        )
        iteration.add_metric(
            [name],
            [
                (str(float(b)), float(c))
                for b, c in zip(
                    ITERATION_TOKEN_BUCKETS, buckets or (0,) * len(ITERATION_TOKEN_BUCKETS), strict=True
                )
            ]
            + [("+Inf", float(steps))],
            float(tokens),
        )
        yield iteration
        # Speculative decoding (vLLM's names; zero when it is off).
        for metric, doc, attr in (
            ("vllm:spec_decode_num_drafts", "Verified draft sequences.", "spec_num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Proposed draft tokens.", "spec_num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens.", "spec_num_accepted_tokens"),
        ):
            yield counter(metric, doc, float(getattr(stats, attr)) if stats else 0.0)
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens at each draft position.",
            labels=["model_name", "position"],
        )
        for pos, value in enumerate(stats.spec_accepted_per_pos if stats else ()):
            per_pos.add_metric([name, str(pos)], float(value))
        yield per_pos
        kv_events = m.kv_events_source()
        if kv_events is not None:
            yield counter(
                "kubeinfer_kv_events_published",
                "KV-cache event batches published over ZMQ (--kv-events-config).",
                float(kv_events[0]),
            )
            yield counter(
                "kubeinfer_kv_events_dropped",
                "KV-cache events dropped because the publisher's queue was full.",
                float(kv_events[1]),
            )
        if m.cache_config is not None:
            # vLLM's info gauge (value 1): the Inference Extension's endpoint picker reads block_size and
            # num_gpu_blocks from it for its prefix-cache scorer
            keys = sorted(m.cache_config)
            cache_info = GaugeMetricFamily(
                "vllm:cache_config_info", "Information of the KV cache config.", labels=keys
            )
            cache_info.add_metric([m.cache_config[k] for k in keys], 1.0)
            yield cache_info
        if m.max_lora is not None:
            # vLLM's shape: the adapters as comma-joined label values, the value the sample time (the
            # Gateway API inference extension reads it for LoRA-affine routing)
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running and waiting LoRA adapters.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            info.add_metric(
                [
                    str(m.max_lora),
                    ",".join(stats.waiting_lora_adapters) if stats else "",
                    ",".join(stats.running_lora_adapters) if stats else "",
                ],
                time.time(),
            )
            yield info
        yield gauge("tgi_queue_size", "Requests waiting to be scheduled (TGI name).", waiting)
        yield gauge("tgi_batch_current_size", "Requests in the running batch (TGI name).", running)
        yield gauge(
            "tgi_batch_current_max_tokens",
            "Tokens in the last engine step (TGI name).",
            float(stats.num_batched_tokens) if stats else 0.0,
        )
        yield gauge(
            "kubeinfer_requests_in_flight",
            "HTTP generation requests admitted and not finished.",
            float(m.in_flight_source()),
        )
        yield gauge(
            "kubeinfer_ready",
            "1 when the model is loaded and the server is not draining.",
            1.0 if m.ready_source() else 0.0,
        )
        # TGI's counters carry no _total suffix; prometheus_client would add one to a counter type, so
        # they are built untyped and typed in render().
        for metric, doc, key in (
            (TGI_COUNTERS[0], "Generation requests received (TGI name).", "count"),
            (TGI_COUNTERS[1], "Generation requests that succeeded (TGI name).", "success"),
        ):
            u = UnknownMetricFamily(metric, doc, labels=["model_name"])
            u.add_metric([name], float(counts.get(key, 0)))
            yield u
        fail = UnknownMetricFamily(
            TGI_COUNTERS[2], "Failed requests by error type (TGI name).", labels=["model_name", "err"]
        )
        for err, value in sorted(counts.items()):
            if err.startswith("failure:"):
                fail.add_metric([name, err.removeprefix("failure:")], float(value))
        yield fail
        task = GaugeMetricFamily(
            "kubeinfer_model_task_info",
            "The task the model serves (--task), as a label.",
            labels=["model_name", "task"],
        )
        task.add_metric([name, m.task], 1.0)
        yield task
        if m.pooling_source is not None:
            pooling = m.pooling_source()
            for metric, doc, key in (
                ("kubeinfer_pooling_sequences", "Sequences pooled (embedded or scored).", "num_sequences"),
                (
                    "kubeinfer_pooling_prompt_tokens",
                    "Tokens run through the pooling model.",
                    "num_prompt_tokens",
                ),
                ("kubeinfer_pooling_steps", "Batched forward passes of the pooling engine.", "num_steps"),
            ):
                yield counter(metric, doc, float(pooling.get(key, 0)))
            yield gauge(
                "kubeinfer_pooling_sequences_waiting",
                "Sequences waiting for the pooling engine's next step.",
                float(pooling.get("num_waiting", 0)),
            )
            yield gauge(
                "kubeinfer_pooling_step_threads",
                "Intra-op threads the pooling engine's last step ran with (measured choice, at most --num-threads).",
                float(pooling.get("last_step_threads", 0)),
            )
        structured = m.structured_source() if m.structured_source is not None else {}
        for metric, doc, key in (
            (
                "kubeinfer_structured_output_mask_seconds",
                "Engine time spent filling and applying grammar token bitmasks (part of each step).",
                "mask_seconds",
            ),
            ("kubeinfer_structured_output_mask_rows", "Logits rows masked by a grammar.", "mask_rows"),
            (
                "kubeinfer_structured_output_mask_steps",
                "Engine steps that applied a grammar mask.",
                "mask_steps",
            ),
            (
                "kubeinfer_structured_output_compile_seconds",
                "Time spent compiling grammars (cache misses).",
                "compile_seconds",
            ),
            ("kubeinfer_structured_output_compile_cache_hits", "Grammar compile cache hits.", "cache_hits"),
        ):
            yield counter(metric, doc, float(structured.get(key, 0.0)))


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats_source: Callable[[], SchedulerStats | None],
        in_flight_source: Callable[[], int],
        ready_source: Callable[[], bool],
    ) -> None:
        self.model_name = model_name
        self.stats_source = stats_source
        self.in_flight_source = in_flight_source
        self.ready_source = ready_source
        # (batches published, events dropped) by the KV-event publisher; None while it is off.
        self.kv_events_source: Callable[[], tuple[int, int] | None] = lambda: None
        self.max_lora: int | None = None  # --max-loras once an engine with LoRA is attached
        # vllm:cache_config_info's labels (block_size, num_gpu_blocks, ...) once an engine is attached
        self.cache_config: dict[str, str] | None = None
        self.task = "generate"  # --task resolved (generate, embed, score)
        # server/pooling's counters (PoolingStats as a dict) once a pooling model is attached
        self.pooling_source: Callable[[], dict[str, float]] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        r = self.registry
        lbl = ["model_name"]
        self.http_requests = Counter(
            "kubeinfer_http_requests",
            "HTTP requests by route and status.",
            [*lbl, "route", "status"],
            registry=r,
        )
        self.reasoning_tokens = Counter(
            "kubeinfer_reasoning_tokens",
            "Generated tokens a --reasoning-parser split off as thinking (vllm:generation_tokens counts all).",
            lbl,
            registry=r,
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*lbl, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", lbl, buckets=_ITL_BUCKETS, registry=r
        )
        # vLLM's older name of the same histogram, which dashboards still query
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time between tokens (vLLM's older name of vllm:inter_token_latency_seconds).",
            lbl,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.inference_time = Histogram(
            "vllm:request_inference_time_seconds",
            "First scheduled to finish (prefill and decode).",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.params_n = Histogram(
            "vllm:request_params_n",
            "The n parameter of admitted OpenAI requests.",
            lbl,
            buckets=(1, 2, 5, 10, 20),
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency.", lbl, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time waiting before first scheduled.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "First scheduled to first token.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "vllm:request_decode_time_seconds",
            "First token to finish.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens_hist = Histogram(
            "vllm:request_prompt_tokens", "Prompt length.", lbl, buckets=_TOKEN_BUCKETS, registry=r
        )
        self.gen_tokens_hist = Histogram(
            "vllm:request_generation_tokens", "Generated tokens.", lbl, buckets=_TOKEN_BUCKETS, registry=r
        )
        self.tgi_duration = Histogram(
            "tgi_request_duration", "Request duration (TGI name).", lbl, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tgi_queue_duration = Histogram(
            "tgi_request_queue_duration", "Queue time (TGI name).", lbl, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tgi_inference_duration = Histogram(
            "tgi_request_inference_duration",
            "Inference time (TGI name).",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tgi_time_per_token = Histogram(
            "tgi_request_mean_time_per_token_duration",
            "Mean time per token (TGI name).",
            lbl,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.tgi_generated_tokens = Histogram(
            "tgi_request_generated_tokens",
            "Generated tokens (TGI name).",
            lbl,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.tgi_input_length = Histogram(
            "tgi_request_input_length", "Prompt tokens (TGI name).", lbl, buckets=_TOKEN_BUCKETS, registry=r
        )
        self.structured_requests = Counter(
            "kubeinfer_structured_output_requests",
            "Requests with a structured-output constraint, by kind (json, json_object, regex, choice, grammar).",
            [*lbl, "kind"],
            registry=r,
        )
        # Set by the server once the engine is loaded: cumulative grammar mask/compile figures.
        self.structured_source: Callable[[], dict[str, float]] | None = None
        self.lora_requests = Counter(
            "kubeinfer_lora_requests",
            "Generation requests per LoRA adapter.",
            [*lbl, "lora_name"],
            registry=r,
        )
        r.register(_EngineCollector(self))

    # ---- counters kept here (exposed by the collector) ----------------------------------------------
    def _bump(self, key: str) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def snapshot_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def request_received(self) -> None:
        self._bump("count")

    def request_succeeded(self) -> None:
        self._bump("success")

    def request_failed(self, err: str) -> None:
        """err: TGI's error type (validation, overloaded, generation, incomplete_generation, unavailable)."""
        self._bump(f"failure:{err}")

    def structured_request(self, kind: str) -> None:
        self.structured_requests.labels(model_name=self.model_name, kind=kind).inc()

    def reasoning_tokens_generated(self, n: int) -> None:
        """Output tokens a --reasoning-parser counted as thinking (the rest of the output is the answer)."""
        if n > 0:
            self.reasoning_tokens.labels(model_name=self.model_name).inc(n)

    def request_params(self, n: int) -> None:
        self.params_n.labels(model_name=self.model_name).observe(n)

    def lora_request(self, lora_name: str) -> None:
        self.lora_requests.labels(model_name=self.model_name, lora_name=lora_name).inc()

    def http_request(self, route: str, status: int) -> None:
        self.http_requests.labels(model_name=self.model_name, route=route, status=str(status)).inc()

    def request_finished(self, t: FinishedRequestTimes) -> None:
        name = self.model_name
        self.request_success.labels(model_name=name, finished_reason=t.finished_reason).inc()
        self.e2e.labels(model_name=name).observe(max(0.0, t.finished_time - t.arrival_time))
        self.tgi_duration.labels(model_name=name).observe(max(0.0, t.finished_time - t.arrival_time))
        self.prompt_tokens_hist.labels(model_name=name).observe(t.num_prompt_tokens)
        self.tgi_input_length.labels(model_name=name).observe(t.num_prompt_tokens)
        self.gen_tokens_hist.labels(model_name=name).observe(t.num_generation_tokens)
        self.tgi_generated_tokens.labels(model_name=name).observe(t.num_generation_tokens)
        if t.first_scheduled_time is not None:
            queue = max(0.0, t.first_scheduled_time - t.arrival_time)
            self.queue_time.labels(model_name=name).observe(queue)
            self.tgi_queue_duration.labels(model_name=name).observe(queue)
            inference = max(0.0, t.finished_time - t.first_scheduled_time)
            self.tgi_inference_duration.labels(model_name=name).observe(inference)
            self.inference_time.labels(model_name=name).observe(inference)
            if t.num_generation_tokens > 0:
                self.tgi_time_per_token.labels(model_name=name).observe(inference / t.num_generation_tokens)
            if t.first_token_time is not None:
                self.prefill_time.labels(model_name=name).observe(
                    max(0.0, t.first_token_time - t.first_scheduled_time)
                )
        if t.first_token_time is not None:
            self.ttft.labels(model_name=name).observe(max(0.0, t.first_token_time - t.arrival_time))
            self.decode_time.labels(model_name=name).observe(max(0.0, t.finished_time - t.first_token_time))
        itl, tpot = self.itl.labels(model_name=name), self.tpot.labels(model_name=name)
        for gap in t.inter_token_latencies:
            itl.observe(max(0.0, gap))
            tpot.observe(max(0.0, gap))

    def render(self) -> bytes:
        """The Prometheus text format (0.0.4). TGI's request counters are counters named without
        `_total`, as TGI's exporter writes them; prometheus_client can only type them untyped (its
        counter families add the suffix), so their TYPE lines are set here."""
        text = generate_latest(self.registry)
        for metric in TGI_COUNTERS:
            text = text.replace(
                f"# TYPE {metric} untyped\n".encode(), f"# TYPE {metric} counter\n".encode(), 1
            )
        return text
