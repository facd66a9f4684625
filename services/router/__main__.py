"""python -m services.router [flags]: the affinity router (Ranker API front door + signal consumer).

Logs a JSON line with event "router_ready" (port, metrics_port, rankers) once it serves.
"""

from __future__ import annotations

import sys

from services.router.config import RouterConfig
from services.router.service import serve
from shared.config import ConfigError, load_config
from shared.lifecycle import die_with_parent
from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    try:
        config = load_config(RouterConfig, sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"relaygr router: {exc}", file=sys.stderr)
        return 2
    configure_logging("router", config.log_level)
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
