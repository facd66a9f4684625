"""`python -m services.expander [--socket-path P] [--arena-bytes N] [--ttl-s S] ...`: run the daemon.

Flags override RELAYGR_EXPANDER_* env vars, which override defaults (`--help` lists them). Logs one
JSON line per event on stderr; the first after start-up is event "expander_ready" (socket path,
arena bytes, generation, metrics port). Exit status: 0 after SIGTERM/SIGINT, 2 on bad
configuration, 1 when start-up (or serving) fails, 130 on SIGINT during start-up.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from services.expander.config import ExpanderConfig
from services.expander.server import DaemonStartError, ExpanderDaemon
from shared.config import ConfigError, load_config
from shared.lifecycle import die_with_parent
from shared.logging import configure_logging, get_logger


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()
    try:
        config = load_config(ExpanderConfig, sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging("expander", config.log_level)
    daemon = ExpanderDaemon(config)
    try:
        try:
            import uvloop
        except ImportError:  # optional: plain asyncio serves the same protocol
            asyncio.run(daemon.run())
        else:
            uvloop.run(daemon.run())
    except (DaemonStartError, OSError) as exc:
        get_logger("services.expander").error("expander_failed", error=str(exc))
        return 1
    except KeyboardInterrupt:  # SIGINT before the loop's handler was installed (during prefault)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
