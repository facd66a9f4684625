"""python -m services.trigger [flags]: the sequence-aware trigger (a consumer-group member)."""

from __future__ import annotations

import sys

from services.trigger.config import TriggerConfig
from services.trigger.service import serve
from shared.lifecycle import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("trigger", TriggerConfig, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
