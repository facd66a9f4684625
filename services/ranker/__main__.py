"""python -m services.ranker [flags]: one ranker instance (one accelerator, or one CPU process)."""

from __future__ import annotations

import sys

from services.ranker.config import RankerConfig
from services.ranker.service import serve
from shared.config import ConfigError, load_config
from shared.lifecycle import die_with_parent
from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    try:
        config = load_config(RankerConfig, sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"relaygr ranker: {exc}", file=sys.stderr)
        return 2
    configure_logging("ranker", config.log_level)
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
