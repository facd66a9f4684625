"""python -m services.router [flags]: the affinity router (the Ranker API + the signal consumer).

Logs a JSON line with event "router_ready" (port, metrics_port, rankers) once it serves. Exits 0
after SIGTERM / SIGINT (calls in flight drained), 1 when the start or a background task failed, 2
for invalid configuration.
"""

from __future__ import annotations

import os

# gRPC's EventEngine endpoints hand every socket read and write to a pool of threads, and grpc.aio's
# poller thread then hands each completion to the event loop: ~20 thread switches per forwarded
# call. gRPC's older I/O manager reads and writes on the poller thread itself: ~7 fewer switches
# and ~100 us less CPU per routed call on the 2-core build machine (bench/router.py). gRPC reads
# the variable once, when it is first imported: hence here, before any import that pulls it in.
# A GRPC_EXPERIMENTS already in the environment is kept as it is.
ROUTER_GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
os.environ.setdefault("GRPC_EXPERIMENTS", ROUTER_GRPC_EXPERIMENTS)

import sys  # noqa: E402

from services.router.config import RouterConfig  # noqa: E402
from services.router.service import serve  # noqa: E402
from shared.lifecycle import run_service  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run_service("router", RouterConfig, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
