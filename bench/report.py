"""Result files shared by every benchmark (schema: ../shared/EVALUATION.md).

`{"machine": {...}, "config": {...}, "results": [...]}` as JSON, plus a markdown table beside it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shared.stats import median, percentile

__all__ = [
    "machine",
    "markdown_table",
    "median",
    "parse_metrics",
    "percentile",
    "scrape_metrics",
    "write_result",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def device_slug(name: str | None = None) -> str:
    name = name or device_name()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _commit() -> str:
    """The checked-out commit; RELAYGR_COMMIT where the tree travels without .git (device runs)."""
    if os.environ.get("RELAYGR_COMMIT"):
        return os.environ["RELAYGR_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "device": device_name(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "commit": _commit(),
    }


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_result(
    name: str,
    config: dict[str, Any],
    results: list[dict[str, Any]],
    columns: Sequence[str],
    out_dir: Path = RESULTS_DIR,
    header: str = "",
    tag: str = "",
    footer: str = "",
) -> tuple[Path, Path]:
    """Writes <name>-<device>[-<tag>].json and .md (title, header, the results table, footer);
    returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    stem = f"{name}-{device_slug(info['device'])}{'-' + tag if tag else ''}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps({"machine": info, "config": config, "results": results}, indent=2) + "\n")
    title = f"# {name} on {info['device']} (commit {info['commit']})\n\n"
    md_path.write_text(title + header + markdown_table(results, columns) + footer)
    return json_path, md_path


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus exposition text, keyed by `name` or `name{labels}` exactly as
    written (comments and blank lines skipped). ValueError on a line that is not a sample."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if not head:
            raise ValueError(f"not a Prometheus sample: {line!r}")
        out[head] = float(value)
    return out


def scrape_metrics(port: int, host: str = "127.0.0.1", timeout_s: float = 5.0) -> dict[str, float]:
    """The samples of a service's /metrics endpoint (blocking; OSError when unreachable)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as reply:
        return parse_metrics(reply.read().decode())
