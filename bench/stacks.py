"""What a py-spy profile of a service says, per thread: where its samples went.

    python -m bench.stacks pyspy-1.txt                   # every thread, its top functions
    python -m bench.stacks pyspy-1.txt --thread engine   # threads whose name matches
    python -m bench.stacks pyspy-1.txt --json out.json

Reads py-spy's raw output (`py-spy record --format raw --threads`, as bench/device/goodput.sh
records the ranker with PYSPY_S set): one line per distinct stack, `thread (TID): NAME;frame;...
COUNT`, each frame `function (file:line)`. Per thread: its samples and share of all, then the
functions with the most samples anywhere in the stack (`inclusive`: time spent in it or in what
it called) and at the top of the stack (`self`). Frames are merged across lines of a file
(`function (file)`), so a function is one row. With `--idle` recorded, a thread waiting (a lock,
a condition, select) is sampled in that wait: its self share says how much of the time it waited.

What it is for: at L4096 on an H200 the relay's device loop spent 1.14 ms a batch between launches
against the baseline's 0.34 (its loop sections; the capacity model puts the relay's limit there),
and the sections do not say which calls inside them cost it.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_THREAD = re.compile(r"^thread \((?P<tid>[^)]*)\)(?::\s*(?P<name>.*))?$")
_FRAME_LINE = re.compile(r"^(?P<func>.*) \((?P<file>.*?)(?::\d+)?\)$")


def frame_key(frame: str) -> str:
    """`function (file)` for `function (file:line)`: one row per function, whatever the line."""
    match = _FRAME_LINE.match(frame.strip())
    if match is None:
        return frame.strip()
    return f"{match['func']} ({match['file']})"


def read(lines: Iterable[str]) -> dict[str, list[tuple[list[str], int]]]:
    """Stacks by thread (`NAME (TID)`, or the first element as it is where it names no thread):
    each stack's frames, outermost first, and its samples. ValueError for a line that is not
    `stack count`."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for number, raw in enumerate(lines, 1):
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"line {number}: not py-spy's raw format (`stack count`): {line[:80]!r}")
        parts = match["stack"].split(";")
        head = _THREAD.match(parts[0])
        if head is not None:
            thread = f"{head['name'] or 'thread'} ({head['tid']})"
            frames = parts[1:]
        else:
            thread, frames = "(no thread)", parts
        threads[thread].append(([frame_key(f) for f in frames], int(match["count"])))
    return threads


def summarise(threads: dict[str, list[tuple[list[str], int]]], top: int = 15) -> list[dict[str, Any]]:
    """Per thread, busiest first: its samples, its share of all, and its `top` functions by
    inclusive and by self samples (each with its share of the thread's samples)."""
    total = sum(count for stacks in threads.values() for _, count in stacks) or 1
    out = []
    for thread, stacks in threads.items():
        samples = sum(count for _, count in stacks)
        inclusive: collections.Counter[str] = collections.Counter()
        own: collections.Counter[str] = collections.Counter()
        for frames, count in stacks:
            for frame in set(frames):  # a recursive function counts once per sample
                inclusive[frame] += count
            if frames:
                own[frames[-1]] += count
        out.append({
            "thread": thread,
            "samples": samples,
            "share": samples / total,
            "inclusive": [(f, n / samples) for f, n in inclusive.most_common(top)],
            "self": [(f, n / samples) for f, n in own.most_common(top)],
        })  # fmt: skip
    return sorted(out, key=lambda row: -row["samples"])


def report(rows: Sequence[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        lines.append(f"## {row['thread']}: {row['samples']} samples, {row['share']:.1%} of all")
        lines.append("| inclusive | function | self | function |")
        lines.append("|---:|---|---:|---|")
        for (inc_f, inc), (own_f, own) in zip(row["inclusive"], row["self"], strict=False):
            lines.append(f"| {inc:.1%} | {inc_f} | {own:.1%} | {own_f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stacks", description=__doc__.split("\n\n")[0])
    p.add_argument("profile", type=Path, help="py-spy record --format raw --threads output")
    p.add_argument("--thread", default=None, help="only threads whose name matches this regular expression")
    p.add_argument("--top", type=int, default=15, help="functions listed per thread (default 15)")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = p.parse_args(argv)
    if args.top < 1:
        p.error("--top: at least 1")
    try:
        pattern = re.compile(args.thread) if args.thread else None
    except re.error as exc:
        p.error(f"--thread: {exc}")
    try:
        with args.profile.open() as f:
            threads = read(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        p.error(f"{args.profile}: {exc}")
    rows = summarise(threads, args.top)
    if pattern is not None:
        rows = [r for r in rows if pattern.search(r["thread"])]
    print(report(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
