"""python -m services.router [flags]: the affinity router (Ranker API front door + signal consumer).

Logs a JSON line with event "router_ready" (port, metrics_port, rankers) once it serves.
"""

from __future__ import annotations

import sys

from services.router.config import RouterConfig
from services.router.service import serve
from shared.lifecycle import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("router", RouterConfig, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
