"""`relaygr`: the command-line entry point.

Every command checks all of its values before it starts anything (a process, a model, a timed
run): argparse types reject malformed flags, then the services' own config classes check what
the stack will run with (relaygr/preflight.py), flags and RELAYGR_* environment alike. A bad value
ends in one line on stderr, `relaygr: error: ...`, and exit status 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable
from typing import NoReturn

from shared.config import ConfigError
from shared.modelspec import PRESETS

EXIT_USAGE = 2  # argparse's status for a bad command line
EXIT_FAILED = 1


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) naming where to read more."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see `{self.prog} --help`)")


def fail(message: str, status: int = EXIT_USAGE) -> NoReturn:
    """Prints `relaygr: error: <message>` (one line) to stderr and exits with `status` (2: a bad
    value; 1: the command could not do its job, e.g. no broker at the given address)."""
    sys.stderr.write(f"relaygr: error: {' '.join(message.split())}\n")
    raise SystemExit(status)


def _integer(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def session_requests(text: str) -> float:
    """A finite number >= 1: a session's mean requests (1: every user comes once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 1, got {text!r}") from None
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (NaN and infinity are refused: no SLO or budget means either)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def bootstrap_servers(text: str) -> str:
    """Kafka bootstrap servers: host:port[,host:port...], ports 1-65535."""
    servers = [s.strip() for s in text.split(",")]
    for server in servers:
        host, sep, port = server.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) <= 65535):
            raise argparse.ArgumentTypeError(
                f"must be host:port[,host:port...] with ports 1-65535, got {server!r}"
            )
    return ",".join(servers)


positive_int = _integer(1)
non_negative_int = _integer(0)


def _preset_help() -> str:
    shapes = "; ".join(
        f"{name}: {s.num_layers} layers, {s.num_heads} heads x {s.head_dim}, {s.dtype}"
        for name, s in sorted(PRESETS.items())
    )
    return f"model preset ({shapes}; default: %(default)s)"


def _demo(args: argparse.Namespace) -> int:
    if args.core_only:
        from relaygr.core_demo import print_core_demo, run_core_demo

        print_core_demo(run_core_demo(users=4, seed=args.seed, prefix_len=2000))
        return 0
    from relaygr.demo import DemoConfig, check, main
    from relaygr.preflight import one_line

    config = DemoConfig(duration_s=args.duration_s, rate_rps=args.rate, slo_ms=args.slo_ms, seed=args.seed,
                        rankers=args.rankers)  # fmt: skip
    try:
        check(config)
    except ConfigError as exc:
        fail(one_line(exc))
    return main(config)


def _up(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaConnectionError

    from relaygr.launcher import StackConfig, run_until_interrupted
    from relaygr.preflight import check_stack, one_line

    if args.rankers_per_gpu > 1 and args.device != "cuda":
        fail("--rankers-per-gpu places ranker processes on GPUs: it needs --device cuda")
    config = StackConfig(
        rankers=args.rankers,
        device=args.device,
        preset=args.preset,
        kafka_bootstrap=args.kafka or "",
        trigger_policy=args.policy,
        expander=not args.no_expander,
        placement=args.placement,
        slo_ms=args.slo_ms,
        hbm_budget_mb=args.hbm_budget_mb,
        rankers_per_device=args.rankers_per_gpu,
        mps=args.mps,
    )
    try:
        check_stack(config)
    except ConfigError as exc:
        fail(one_line(exc))
    # This process's only Kafka client creates the topics, retrying for 30 s while no broker
    # answers; its per-attempt connection errors (~5 a second) would bury the one line below.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        return run_until_interrupted(config)
    except KafkaConnectionError:
        # Raised before any service starts (topics are created first); the launcher retried for 30 s.
        fail(f"no Kafka broker answers at {config.kafka_bootstrap} (tried for 30 s)", EXIT_FAILED)


def _plan(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from relaygr.plan import plan, plot, sensitivity, sensitivity_table, table
    from relaygr.sim import modelled_configs, parse_trigger_settings
    from relaygr.workload import read_length_histogram

    changes = {
        k: v for k, v in (("arena_gb", args.arena_gb), ("hbm_budget_mb", args.hbm_budget_mb)) if v is not None
    }
    source = Path(args.source)
    try:
        settings = parse_trigger_settings(args.trigger_setting)
        if args.configs is None:
            configs = modelled_configs(source)
            if not configs:
                raise ValueError(f"{source.name} holds no configuration the model covers")
        else:
            configs = [c.strip() for c in args.configs.split(",") if c.strip()]
            if not configs:
                raise ValueError("--configs: name at least one configuration")
        session = {
            k: v
            for k, v in (
                ("session_mean_requests", args.session_mean_requests),
                ("think_scale", args.think_scale),
            )
            if v is not None
        }
        lengths = read_length_histogram(Path(args.lengths)) if args.lengths else ()
        rows = plan(source, configs, args.target_rps, args.workload, args.slo_ms, args.users, changes,
                    trigger_settings=settings, session=session, lengths=lengths)  # fmt: skip
        varied = []
        if args.sensitivity:
            varied = sensitivity(source, configs, args.target_rps, rows, args.workload, args.slo_ms, changes,
                                 settings, session, lengths)  # fmt: skip
        if args.plot:
            plot(rows, Path(args.plot))
    except ValueError as exc:
        fail(str(exc))
    print(table(rows))
    for r in rows:
        if r.get("extrapolated"):
            low, high = r["calibrated_call_tokens"]
            print(f"note: {r['config']}: --lengths gives prefixes of {r['prefix_tokens'][0]}-{r['prefix_tokens'][2]} "
                  f"tokens; the run measured full rankings of {low}-{high} tokens with their suffixes: costs "
                  "outside that are extrapolated by the fit")  # fmt: skip
    if varied:
        print()
        print(sensitivity_table(varied))
    if args.json:
        Path(args.json).write_text(json.dumps({"plans": rows, "sensitivity": varied}, indent=1) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (subcommands `demo`, `up` and `plan`); errors exit via `fail`."""
    parser = _Parser(
        prog="relaygr",
        description="RelayGR: relay-race inference for generative-recommendation ranking.",
        epilog="Settings not listed here are read by each service from RELAYGR_* environment variables "
        "(`python -m services.<name> --help` lists them); they are checked before anything starts.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,up,plan}")

    demo = sub.add_parser(
        "demo",
        help="relay vs baseline on the CPU: the model-level comparison, then the whole stack twice",
        description="Compares full vs cached inference of the tiny model, then brings the whole stack up "
        "twice on the CPU (baseline, then relay) and replays the same open-loop workload through each.",
    )
    demo.add_argument("--duration-s", type=positive_float, default=60.0, metavar="S",
                      help="replay length per configuration, seconds (default: %(default)s)")  # fmt: skip
    demo.add_argument("--rate", type=positive_float, default=1.5, metavar="RPS",
                      help="offered ranking requests per second (default: %(default)s)")  # fmt: skip
    demo.add_argument("--slo-ms", type=positive_float, default=None, metavar="MS",
                      help="ranking SLO in ms (default: calibrated on this machine: the measured full "
                      "ranking of the workload's p90-length request)")  # fmt: skip
    demo.add_argument("--rankers", type=positive_int, default=1, metavar="N",
                      help="ranker processes per stack (default: %(default)s)")  # fmt: skip
    demo.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                      help="seed of the workload and the model weights (default: %(default)s)")  # fmt: skip
    demo.add_argument("--core-only", action="store_true",
                      help="only the model-level comparison (seconds; options but --seed are ignored) "
                      "(default: the whole demo)")  # fmt: skip
    demo.set_defaults(func=_demo)

    up = sub.add_parser(
        "up",
        help="start the whole relay (broker, expander, rankers, router, trigger) until Ctrl-C",
        description="Starts every service as its own process, streams their logs, stops all on Ctrl-C.",
    )
    up.add_argument("--rankers", type=positive_int, default=2, metavar="N",
                    help="ranker instances; with --device cuda ranker i runs on GPU i, or on GPU i // K with "
                    "--rankers-per-gpu K (default: %(default)s)")  # fmt: skip
    up.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the rankers run: cpu, or cuda (needs --rankers GPUs) (default: %(default)s)")  # fmt: skip
    up.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help=_preset_help())
    up.add_argument("--kafka", type=bootstrap_servers, default=None, metavar="HOST:PORT[,...]",
                    help="an existing Kafka's bootstrap servers (default: start the embedded broker)")  # fmt: skip
    up.add_argument("--policy", choices=["sequence", "all", "off"], default="sequence",
                    help="trigger policy: sequence pre-infers the requests at risk of missing the SLO, all "
                    "pre-infers every request, off never (default: %(default)s)")  # fmt: skip
    up.add_argument("--no-expander", action="store_true",
                    help="run without the host-DRAM tier (default: with it)")  # fmt: skip
    up.add_argument("--placement", choices=["affinity", "round_robin"], default="affinity",
                    help="router placement: affinity sends a user's calls to the instance holding its psi, "
                    "round_robin ignores it (needs >= 2 rankers) (default: %(default)s)")  # fmt: skip
    up.add_argument("--slo-ms", type=positive_float, default=50.0, metavar="MS",
                    help="ranking P99 SLO the trigger admits pre-inference against (default: %(default)s)")  # fmt: skip
    up.add_argument("--hbm-budget-mb", type=positive_float, default=512.0, metavar="MB",
                    help="psi bytes each ranker keeps in accelerator memory, MiB (default: %(default)s)")  # fmt: skip
    up.add_argument("--rankers-per-gpu", type=positive_int, default=1, metavar="K",
                    help="with --device cuda: K ranker processes share each GPU (ranker i on GPU i // K), "
                    "each with its own interpreter, so that a GPU is not held back by one process's host "
                    "work; split the GPU's psi budget among them with --hbm-budget-mb (on an H200, the "
                    "length mix: 660.9-734.4 req/s with 2 under --mps, 421.9 with 1) (default: %(default)s)")  # fmt: skip
    up.add_argument("--mps", action="store_true",
                    help="with --device cuda: the rankers are clients of an NVIDIA MPS daemon of the stack's "
                    "own, so that the kernels of processes sharing a GPU run side by side instead of taking "
                    "time slices; nothing else on the GPU changes (default: off)")  # fmt: skip
    up.set_defaults(func=_up)

    plan = sub.add_parser(
        "plan",
        help="GPUs needed for a target rate, per configuration, from the capacity model (CPU, seconds)",
        description="Models one GPU's goodput under the SLO from a measured goodput run (relaygr.sim), "
        "then the GPUs a target rate needs, each serving its own users.",
    )
    plan.add_argument("--from", dest="source", required=True, metavar="FILE",
                      help="a bench.goodput result file with its calls/ directory beside it (the calibration)")  # fmt: skip
    plan.add_argument("--target-rps", type=positive_float, required=True, metavar="RPS",
                      help="ranking requests per second the fleet must serve under the SLO")  # fmt: skip
    plan.add_argument("--configs", default=None, metavar="A,B",
                      help="configurations to plan, each modelled from the file's records of it "
                      "(baseline, relay, relay-nospare, preinfer-all, ...; default: every one the file "
                      "holds that the model covers)")  # fmt: skip
    plan.add_argument("--trigger-setting", action="append", default=[], metavar="NAME=VALUE",
                      help="relay: one of the trigger's admission settings instead of the run's (e.g. "
                      "spare_min_saving=0.1); repeatable")  # fmt: skip
    plan.add_argument("--workload", default=None, metavar="L<n>|mix",
                      help="the file's workload to plan (default: its only one)")  # fmt: skip
    plan.add_argument("--slo-ms", type=positive_float, default=None, metavar="MS",
                      help="ranking P99 SLO (default: the file's)")  # fmt: skip
    plan.add_argument("--users", type=positive_int, default=None, metavar="N",
                      help="user population, split over the GPUs (default: the file's workload's)")  # fmt: skip
    plan.add_argument("--arena-gb", type=positive_float, default=None, metavar="GB",
                      help="host DRAM for psi per GPU (default: the file's)")  # fmt: skip
    plan.add_argument("--hbm-budget-mb", type=positive_float, default=None, metavar="MB",
                      help="psi bytes in HBM per GPU (default: the file's)")  # fmt: skip
    plan.add_argument("--session-mean-requests", type=session_requests, default=None, metavar="N",
                      help="mean requests of a user's session (geometric, >= 1; 1: no user comes back) "
                      "instead of the file's workload's")  # fmt: skip
    plan.add_argument("--think-scale", type=positive_float, default=None, metavar="X",
                      help="think times between a session's requests: ML-100K's gaps x this, instead of "
                      "the file's workload's")  # fmt: skip
    plan.add_argument("--lengths", default=None, metavar="FILE",
                      help="the users' prefix lengths from a histogram file (one 'upper_length,weight' "
                      "line a bin, lengths increasing) instead of the file's workload; the costs "
                      "stay the file's, extrapolated outside its lengths (the plan says so)")  # fmt: skip
    plan.add_argument("--json", default=None, metavar="FILE", help="also write the plans here")
    plan.add_argument("--plot", default=None, metavar="PNG",
                      help="P99 against the per-GPU rate, per configuration, with the SLO")  # fmt: skip
    plan.add_argument("--sensitivity", action="store_true",
                      help="also the GPUs with one input varied at a time (SLO, DRAM, costs): which matter most")  # fmt: skip
    plan.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
