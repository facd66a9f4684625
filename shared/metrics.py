"""Prometheus metrics: one registry per service instance, served over HTTP on its own port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

# Latency buckets (ms) from sub-millisecond to a few seconds: ranking P99 budgets are tens of ms.
LATENCY_MS_BUCKETS = (
    0.25,
    0.5,
    1,
    2,
    3,
    5,
    7.5,
    10,
    15,
    20,
    30,
    50,
    75,
    100,
    150,
    250,
    500,
    1000,
    2500,
    5000,
)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Starts the /metrics endpoint in a daemon thread; returns the bound port (0 picks one)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_address[1])
