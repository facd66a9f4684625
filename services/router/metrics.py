"""The router's Prometheus metrics (one registry per RouterService, served on its metrics port)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.metrics import LATENCY_MS_BUCKETS


class Children:
    """A labelled metric's children, looked up once per label values: `labels()` validates and
    takes a lock on every call, too slow for every routed call (children are never removed)."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class RouterMetrics:
    """The router's Prometheus metrics, on its own registry; `*_of` look labelled children up once."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency_ms = Histogram(
            "relaygr_router_latency_ms", "routed call latency (entry to reply)", ["method", "result"],
            registry=registry, buckets=LATENCY_MS_BUCKETS,
        )  # fmt: skip
        self.attempts = Counter("relaygr_router_attempts_total", "forwarding attempts by result",
                                ["method", "result"], registry=registry)  # fmt: skip
        self.retries = Counter("relaygr_router_retries_total", "attempts after the first", ["method"],
                               registry=registry)  # fmt: skip
        self.placement = Counter("relaygr_router_placement_total", "placement decisions by source",
                                 ["method", "source"], registry=registry)  # fmt: skip
        self.members = Gauge(
            "relaygr_router_healthy_instances", "healthy ranker instances", registry=registry
        )
        self.residency = Gauge("relaygr_router_residency_entries", "users in the residency map",
                               registry=registry)  # fmt: skip
        self.signals = Counter("relaygr_router_signals_total", "pre-infer signals by outcome "
                               "(forwarded, refused, dlq, lost, stale)", ["outcome"], registry=registry)  # fmt: skip
        self.latency_of = Children(self.latency_ms)
        self.attempts_of = Children(self.attempts)
        self.retries_of = Children(self.retries)
        self.placement_of = Children(self.placement)
        self.by_reference = Counter("relaygr_router_rank_by_reference_total",
                                    "ranking calls forwarded with a prefix reference, by result (hit: "
                                    "answered; resent: prefix_required, the whole call followed)",
                                    ["result"], registry=registry)  # fmt: skip
        self.by_reference_of = Children(self.by_reference)
        self.relay_connections = Gauge("relaygr_router_relay_connections",
                                       "client connections open on the relay front door", registry=registry)  # fmt: skip
        self.relay_errors = Counter("relaygr_router_relay_protocol_errors_total",
                                    "HTTP/2 connections the relay closed for a protocol error, by peer and code",
                                    ["peer", "code"], registry=registry)  # fmt: skip
        self.relay_errors_of = Children(self.relay_errors)
        self.relay_passed = Counter("relaygr_router_relay_passed_through_total",
                                    "streams the relay passed to the router's gRPC server (all but Rank)",
                                    registry=registry)  # fmt: skip
        self.relay_refused = Counter("relaygr_router_relay_refused_streams_total",
                                     "client streams the relay refused while their connection went on, by "
                                     "reason (header_list_too_large, too_many_streams)",
                                     ["reason"], registry=registry)  # fmt: skip
