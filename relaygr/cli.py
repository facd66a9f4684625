"""`relaygr`: the command-line entry point."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from relaygr.core_demo import print_core_demo, run_core_demo

    print_core_demo(run_core_demo(users=args.users, seed=args.seed, prefix_len=args.prefix_len))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relaygr", description="RelayGR: relay-race inference for GR ranking"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the relay-race core on the CPU: full vs cached scores and times")
    demo.add_argument("--users", type=int, default=4)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--prefix-len", type=int, default=2000, help="longest user's prefix length")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
