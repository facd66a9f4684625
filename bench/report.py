"""Result files shared by every benchmark (schema: ../shared/EVALUATION.md).

`{"machine": {...}, "config": {...}, "results": [...]}` as JSON, plus a markdown table beside it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relaygr.harness import device_name, machine, markdown_table
from shared.stats import median, percentile

__all__ = [
    "median",
    "percentile",
    "write_result",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_slug(name: str | None = None) -> str:
    name = name or device_name()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_result(
    name: str,
    config: dict[str, Any],
    results: list[dict[str, Any]],
    columns: Sequence[str],
    out_dir: Path = RESULTS_DIR,
    header: str = "",
    tag: str = "",
    footer: str = "",
    info: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Writes <name>-<device>[-<tag>].json and .md (title, header, the results table, footer);
    returns both paths. `info` describes the machine that measured (default: this one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    info = info or machine()
    stem = f"{name}-{device_slug(info['device'])}{'-' + tag if tag else ''}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps({"machine": info, "config": config, "results": results}, indent=2) + "\n")
    title = f"# {name} on {info['device']} (commit {info['commit']})\n\n"
    if info.get("cpu_model") or info.get("host_probe_ms"):
        # Host-bound limits move with the host: say which one measured (harness.machine).
        title += (f"Host: {info.get('cpu_model') or 'CPU unnamed'}, {info.get('cpu_count')} cores; a fixed "
                  f"Python loop took {info.get('host_probe_ms')} ms (lower: a faster host).\n\n")  # fmt: skip
    md_path.write_text(title + header + markdown_table(results, columns) + footer)
    return json_path, md_path
