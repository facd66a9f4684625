"""python -m services.trigger [flags]: the sequence-aware trigger (a consumer-group member)."""

from __future__ import annotations

import sys

from services.trigger.config import TriggerConfig
from services.trigger.service import serve
from shared.config import ConfigError, load_config
from shared.lifecycle import die_with_parent
from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    try:
        config = load_config(TriggerConfig, sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"relaygr trigger: {exc}", file=sys.stderr)
        return 2
    configure_logging("trigger", config.log_level)
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
