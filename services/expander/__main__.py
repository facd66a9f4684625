"""`python -m services.expander [--socket-path P] [--arena-bytes N] [--ttl-s S] ...`: run the daemon.

Flags override RELAYGR_EXPANDER_* env vars, which override defaults (`--help` lists them). Logs one
JSON line per event on stderr; the first after start-up is event "expander_ready" (socket path,
arena bytes, generation, metrics port). Exit status (shared.lifecycle): 0 after SIGTERM/SIGINT,
2 on bad configuration, 1 when start-up fails (event "expander_failed") or the sweeper dies,
130 on SIGINT before the event loop runs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from services.expander.config import ExpanderConfig
from services.expander.server import ExpanderDaemon
from shared.lifecycle import run_service


def serve(config: ExpanderConfig) -> int:
    """Runs the daemon until it stops; returns its exit status."""
    daemon = ExpanderDaemon(config)
    try:
        import uvloop
    except ImportError:  # optional: plain asyncio serves the same protocol
        return asyncio.run(daemon.run())
    return uvloop.run(daemon.run())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run_service("expander", ExpanderConfig, serve, argv)
    except KeyboardInterrupt:  # SIGINT before the loop's handler was installed
        return 130


if __name__ == "__main__":
    sys.exit(main())
