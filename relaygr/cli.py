"""`relaygr`: the command-line entry point."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    if args.core_only:
        from relaygr.core_demo import print_core_demo, run_core_demo

        print_core_demo(run_core_demo(users=4, seed=args.seed, prefix_len=2000))
        return 0
    from relaygr.demo import DemoConfig, main

    return main(DemoConfig(duration_s=args.duration_s, rate_rps=args.rate, slo_ms=args.slo_ms, seed=args.seed,
                           rankers=args.rankers))  # fmt: skip


def _up(args: argparse.Namespace) -> int:
    from relaygr.launcher import StackConfig, run_until_interrupted

    config = StackConfig(
        rankers=args.rankers,
        device=args.device,
        preset=args.preset,
        kafka_bootstrap=args.kafka,
        trigger_policy=args.policy,
        expander=not args.no_expander,
        placement=args.placement,
        slo_ms=args.slo_ms,
        hbm_budget_mb=args.hbm_budget_mb,
    )
    return run_until_interrupted(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relaygr", description="RelayGR: relay-race inference for GR ranking"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="the relay vs the baseline on the CPU: the whole stack, a replayed workload"
    )
    demo.add_argument("--duration-s", type=float, default=60.0, help="replay length per configuration")
    demo.add_argument("--rate", type=float, default=1.5, help="offered ranking requests per second")
    demo.add_argument("--slo-ms", type=float, default=None,
                      help="ranking SLO (default: calibrated on this machine, the measured full ranking of "
                      "the workload's p90-length request)")  # fmt: skip
    demo.add_argument("--rankers", type=int, default=1)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--core-only", action="store_true", help="only the model-level comparison (seconds)")
    demo.set_defaults(func=_demo)
    up = sub.add_parser("up", help="start the whole relay (broker, expander, rankers, router, trigger)")
    up.add_argument(
        "--rankers", type=int, default=2, help="ranker instances (one per GPU with --device cuda)"
    )
    up.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    up.add_argument("--preset", default="tiny")
    up.add_argument(
        "--kafka", default="", help="Kafka bootstrap servers (default: start the embedded broker)"
    )
    up.add_argument("--policy", choices=["sequence", "all", "off"], default="sequence", help="trigger policy")
    up.add_argument("--no-expander", action="store_true", help="run without the host-DRAM tier")
    up.add_argument("--placement", choices=["affinity", "round_robin"], default="affinity")
    up.add_argument("--slo-ms", type=float, default=50.0)
    up.add_argument("--hbm-budget-mb", type=float, default=512.0)
    up.set_defaults(func=_up)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
