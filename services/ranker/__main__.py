"""python -m services.ranker [flags]: one ranker instance (one accelerator, or one CPU process).

Exit status (shared.lifecycle): 0 after SIGTERM / SIGINT (intake stopped, calls in flight drained),
2 on bad configuration, 1 when start-up or a background task (the lease-expiry loop) failed.
"""

from __future__ import annotations

import sys

from services.ranker.config import RankerConfig
from services.ranker.service import serve
from shared.lifecycle import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("ranker", RankerConfig, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
