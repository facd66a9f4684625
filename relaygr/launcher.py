"""`relaygr up`: the whole relay on one machine, every service a separate process.

Order: the Kafka broker (the embedded Tansu unless a bootstrap is given) and its topics, the
expander, N rankers (CPU processes, or `rankers_per_device` per GPU), the router, the trigger; each is awaited on
its ready log line (which follows its own health checks: the ranker's and router's gRPC health
report SERVING by then). Stopping goes in reverse: SIGTERM, a grace period, then SIGKILL. Every
child asks the kernel to be terminated if the launcher dies (shared/lifecycle.py), and the
expander's arena is a memfd, so nothing is left behind in /dev/shm or the process table.

The switches of StackConfig are the benchmark's configurations:
  baseline      trigger_policy="off", expander=False
  preinfer-all  trigger_policy="all"
  no-affinity   placement="round_robin" (>= 2 rankers)
  no-expander   expander=False
  relay         everything on
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType

from relaygr.mps import MpsDaemon
from relaygr.processes import ServiceProcess
from services.router.config import Placement
from services.trigger.admission import Policy
from shared.broker import EmbeddedBroker
from shared.config import choices
from shared.kafka import KafkaSettings, ensure_topics, make_producer
from shared.settings import DEFAULT_DLQ_TOPIC, DEFAULT_RETRIEVAL_TOPIC, DEFAULT_SIGNAL_TOPIC

RETRIEVAL_TOPIC = DEFAULT_RETRIEVAL_TOPIC
SIGNAL_TOPIC = DEFAULT_SIGNAL_TOPIC
DLQ_TOPIC = DEFAULT_DLQ_TOPIC
# The services' Kafka request timeout on the embedded broker (aiokafka's default is 40 s): after
# a restart of Tansu (Stack.renew_broker) about one consumer in ten on the build machine waited
# that long for a SyncGroup answer that never came; a timeout lets it join again.
REQUEST_TIMEOUT_ENV = "RELAYGR_KAFKA_REQUEST_TIMEOUT_MS"
EMBEDDED_REQUEST_TIMEOUT_MS = 5000
PROBE = b"relaygr renew_broker probe"  # a malformed record: each reader counts it, and dead-letters it


@dataclass(frozen=True)
class StackConfig:
    rankers: int = 1
    device: str = "cpu"  # cpu: ranker processes on the CPU; cuda: ranker i on GPU i // rankers_per_device
    # Ranker processes sharing one GPU, each with its own interpreter, event loop and HBM budget
    # (hbm_budget_mb is each one's): the host's Python work of one GPU's calls split over as many
    # GILs. One process answering ~240 calls/s on an H200 spent the time between its device's
    # batches waiting for its own interpreter (goodput-nvidia-h200-h4b: calls waited up to 59 ms
    # outside the server's handler at 237.5 req/s).
    rankers_per_device: int = 1
    # The rankers as clients of an NVIDIA MPS daemon of the stack's own (relaygr/mps.py): the
    # kernels of processes sharing a GPU may then run side by side instead of by time slices.
    mps: bool = False
    preset: str = "tiny"
    kafka_bootstrap: str = ""  # "" starts the embedded broker
    # Partitions of the retrieval and signal topics. The embedded broker (Tansu, memory storage)
    # works per record held in a partition, and holds every record (retention.ms is not applied,
    # DeleteRecords not served). bench.broker_growth (broker-growth-cpu.json: 100 records/s of 150
    # KB, a RetrievalEvent with its 8192-token prefix, to 13.5k records) on the build machine:
    # produce -> consume p50 3.0 -> 6.1 ms (p99 6.0 -> 12.3) and the broker 0.16 -> 0.46 cores
    # with 4 partitions; 4.4 -> 16.3 ms (p99 to 119) with 1; 3.5 -> 4.1 ms (p99 6.9 -> 9.4) and
    # 0.23 -> 0.29 cores with 32. With 4, a goodput search's later points met a slower signal
    # path than its first: on an H200 (k9b) the trigger's event lag went 8.6 -> 14.5 ms mean with
    # the point order, whatever the rate, and the broker's CPU 0.43 -> 0.79 cores.
    partitions: int = 32
    trigger_policy: str = "sequence"  # sequence | all | off
    expander: bool = True
    placement: str = "affinity"  # affinity | round_robin
    slo_ms: float = 50.0
    hbm_budget_mb: float = 512.0
    arena_bytes: int = 1 << 30
    ranker_args: tuple[str, ...] = ()
    trigger_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)

    def device_index(self, ranker: int) -> int:
        """The GPU of ranker process `ranker` (0 on the CPU)."""
        return ranker // self.rankers_per_device if self.device == "cuda" else 0

    def validate(self) -> None:
        if self.rankers < 1:
            raise ValueError("at least one ranker is needed")
        if self.rankers_per_device < 1:
            raise ValueError(f"rankers_per_device must be >= 1, not {self.rankers_per_device}")
        if self.mps and self.device != "cuda":
            raise ValueError("mps is for rankers on CUDA devices (--device cuda)")
        if self.placement not in choices(Placement):
            raise ValueError(f"unknown placement {self.placement!r} (one of {', '.join(choices(Placement))})")
        if self.placement == Placement.ROUND_ROBIN and self.rankers < 2:
            raise ValueError("the no-affinity ablation (round_robin) needs >= 2 rankers")
        if self.trigger_policy not in choices(Policy):
            raise ValueError(
                f"unknown trigger policy {self.trigger_policy!r} (one of {', '.join(choices(Policy))})"
            )


class Stack:
    """A running relay. Use as a context manager, or call start() / stop().

    start() blocks, runs its own event loop for topic creation (call it outside any running loop),
    and must be called from a thread that outlives the stack (normally the main thread): children
    are terminated when the thread that started them exits."""

    def __init__(self, config: StackConfig, echo: Callable[[str, str], None] | None = None) -> None:
        config.validate()
        self.config = config
        self._echo = echo
        self.broker: EmbeddedBroker | None = None
        self.bootstrap = config.kafka_bootstrap
        self.processes: list[ServiceProcess] = []
        self.retired: list[ServiceProcess] = []  # stopped by respawn(); their logs are kept
        self._spawned: dict[str, tuple[str, dict[str, str], tuple[str, ...]]] = {}  # name: how it was started
        self.rankers: list[ServiceProcess] = []
        self.ranker_targets: list[str] = []
        self.ranker_metrics_ports: list[int] = []
        self.router: ServiceProcess | None = None
        self.router_port = 0
        self.trigger: ServiceProcess | None = None
        self.expander: ServiceProcess | None = None
        self._run_dir = tempfile.mkdtemp(prefix="relaygr-")
        self.mps: MpsDaemon | None = None
        self.mps_active: bool | None = None  # an MPS server came up for the rankers (None: no MPS)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Stack:
        c = self.config
        try:
            if not self.bootstrap:
                self.broker = EmbeddedBroker.start()
                self.bootstrap = self.broker.bootstrap
            asyncio.run(ensure_topics(KafkaSettings(bootstrap=self.bootstrap), self._topics()))
            env = {**os.environ, **c.env}
            if self.broker is not None:  # it may be renewed (renew_broker): see EMBEDDED_REQUEST_TIMEOUT_MS
                env.setdefault(REQUEST_TIMEOUT_ENV, str(EMBEDDED_REQUEST_TIMEOUT_MS))
            socket_path = self.expander_socket
            if c.expander:
                self.start_expander()
            ranker_env = env
            if c.mps:
                self.mps = MpsDaemon(self._run_dir)
                self.mps.start()
                ranker_env = self.mps.client_env(env)
            for i in range(c.rankers):
                # Calls scheduled to finish within half the stack's SLO (a configuration's own
                # ranker_args come after, and win).
                args = ["--device", c.device, "--device-index", str(c.device_index(i)),
                        "--preset", c.preset, "--hbm-budget-mb", str(c.hbm_budget_mb),
                        "--latency-target-ms", f"{c.slo_ms / 2:g}", "--slo-ms", f"{c.slo_ms:g}",
                        "--device-processes", str(c.rankers_per_device if c.device == "cuda" else 1),
                        *c.ranker_args]  # fmt: skip
                if c.expander:
                    args += ["--host-tier", "true", "--expander-socket-path", socket_path]
                self.rankers.append(self._spawn(f"ranker-{i}", "services.ranker", ranker_env, *args))
            for ranker in self.rankers:  # they start in parallel
                ready = ranker.wait_event("ranker_ready", c.startup_timeout_s)
                self.ranker_targets.append(f"127.0.0.1:{ready['port']}")
                self.ranker_metrics_ports.append(int(ready["metrics_port"]))
            if self.mps is not None:
                self.mps_active = self.mps.server_running()
                if not self.mps_active:  # CUDA falls back to plain contexts without a word
                    print("relaygr: the MPS daemon started but no MPS server came up: the rankers run "
                          "without MPS", file=sys.stderr, flush=True)  # fmt: skip
            common = ["--bootstrap", self.bootstrap, "--rankers", ",".join(self.ranker_targets),
                      "--signal-topic", SIGNAL_TOPIC, "--dlq-topic", DLQ_TOPIC,
                      "--topic-partitions", str(c.partitions)]  # fmt: skip
            self.router = self._spawn("router", "services.router", env, *common, "--placement", c.placement,
                                      *c.router_args)  # fmt: skip
            self.trigger = self._spawn("trigger", "services.trigger", env, *common, "--retrieval-topic",
                                       RETRIEVAL_TOPIC, "--policy", c.trigger_policy, "--slo-ms", str(c.slo_ms),
                                       "--preset", c.preset, *c.trigger_args)  # fmt: skip
            self.router_port = int(self.router.wait_event("router_ready", c.startup_timeout_s)["port"])
            self.trigger.wait_event("trigger_ready", c.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def expander_socket(self) -> str:
        return os.path.join(self._run_dir, "expander.sock")

    def start_expander(self) -> ServiceProcess:
        """Starts the expander (again, after a crash: it takes over its stale socket)."""
        c = self.config
        env = {**os.environ, **c.env}
        self.expander = self._spawn("expander", "services.expander", env, "--socket-path", self.expander_socket,
                                    "--arena-bytes", str(c.arena_bytes))  # fmt: skip
        self.expander.wait_event("expander_ready", c.startup_timeout_s)
        return self.expander

    def _topics(self) -> dict[str, int]:
        c = self.config
        return {RETRIEVAL_TOPIC: c.partitions, SIGNAL_TOPIC: c.partitions, DLQ_TOPIC: 1}

    async def renew_broker(
        self, confirm_s: float = 3 * EMBEDDED_REQUEST_TIMEOUT_MS / 1e3, attempts: int = 2
    ) -> bool:
        """An empty embedded broker in place of the running one (same port, the stack's topics
        made again), for a benchmark point that must not pay for the records of the points
        before it: Tansu's memory storage keeps every record, and its fetches slow as its
        partitions fill (bench/broker_growth.py, build machine, 32 partitions, 400 records a
        second of 30 KB: produce -> consume p50 3.2 ms at 12k records held, 221 ms at 48k, 2.2 s
        at 120k; an H200 mix search's trigger saw its event lag reach 881 ms, k15a).

        Returns once the trigger and the router read the new broker: each is sent a malformed
        record (dead-lettered, counted) and must count it within `confirm_s`. A service behind is
        restarted (respawn: same ports), and the check made again, `attempts` checks in all (then
        RuntimeError, naming the services behind and their last log lines). Their consumers
        rejoin within ~1.5 s as a rule; about one renewal in ten on the build machine left a
        consumer's SyncGroup unanswered until its request timed out, which this stack's services
        have at EMBEDDED_REQUEST_TIMEOUT_MS. On an H200 host (k16e, 2026-11-30) a trigger that
        missed one renewal missed every later one, the broker renewed twice each time (its fetches
        to the new broker failing with the connection closed): renewing the broker again does not
        bring such a consumer back, a fresh process does. Call it from the thread that started
        the stack. False, with nothing done, where the stack uses an external broker."""
        if self.broker is None:
            return False
        # Killed, not drained: with clients connected Tansu takes its whole grace period (5 s) to
        # stop on SIGTERM, and a memory-only broker has nothing to keep.
        self.restart_broker(down_s=0.0, stop_timeout_s=0.2)
        await ensure_topics(KafkaSettings(bootstrap=self.bootstrap), self._topics())
        for attempt in range(attempts):
            behind = await self._consumers_behind(confirm_s)
            if not behind:
                return True
            if attempt + 1 < attempts:
                print(f"relaygr: {', '.join(p.name for p in behind)} did not read the renewed broker within "
                      f"{confirm_s:g} s; restarting them", file=sys.stderr, flush=True)  # fmt: skip
                for process in behind:
                    # On this thread, not a worker's: a child asks for SIGTERM when the thread
                    # that started it ends (shared/lifecycle.py), and an executor's threads end
                    # with the event loop.
                    self.respawn(process)
        said = "; ".join(f"{p.name}: {' | '.join(str(r.get('raw') or r.get('event')) for r in p.records()[-6:])}"
                         for p in behind)  # fmt: skip
        raise RuntimeError(f"{', '.join(p.name for p in behind)} did not read the renewed broker within "
                           f"{confirm_s:g} s, {attempts} times (their last log lines: {said})")  # fmt: skip

    async def _consumers_behind(self, within_s: float) -> list[ServiceProcess]:
        """Those of the trigger and the router (those the stack runs) that have not counted a
        malformed record sent to each partition of their topics within `within_s`. Every
        partition: a consumer that read one but not another would drop a search's events
        unseen (a full test run here once saw the trigger read the probe's partition and not,
        for 60 s, the next record's)."""
        readers = [(p, topic, counter, ready) for p, topic, counter, ready in (
            (self.trigger, RETRIEVAL_TOPIC, "relaygr_trigger_dead_letters_total", "trigger_ready"),
            (self.router, SIGNAL_TOPIC, "relaygr_router_signals_total", "router_ready"),
        ) if p is not None]  # fmt: skip
        ports = [int(p.wait_event(ready)["metrics_port"]) for p, _, _, ready in readers]

        async def count(p: ServiceProcess, port: int, counter: str) -> float:
            try:
                return await asyncio.to_thread(p.metric, port, counter, 2.0)
            except OSError:  # not answering (frozen, or gone): it counts as behind
                return math.nan

        async def counts() -> list[float]:
            return [
                await count(p, port, counter) for (p, _, counter, _), port in zip(readers, ports, strict=True)
            ]

        before = await counts()
        producer = make_producer(KafkaSettings(bootstrap=self.bootstrap))
        await producer.start()
        sent = []
        try:
            deliveries = []  # every probe queued first, then awaited together: one batch, not 2 x 32 round trips
            for _, topic, _, _ in readers:
                partitions = sorted(await producer.partitions_for(topic))
                deliveries += [
                    await producer.send(topic, PROBE, partition=partition) for partition in partitions
                ]
                sent.append(len(partitions))
            await asyncio.gather(*deliveries)
        finally:
            await producer.stop()
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            now = await counts()
            behind = [
                p for (p, _, _, _), n, b, k in zip(readers, now, before, sent, strict=True) if not n >= b + k
            ]  # NaN: behind
            if not behind:
                return []
            await asyncio.sleep(0.1)
        return behind

    def restart_broker(self, down_s: float = 1.0, stop_timeout_s: float = 5.0) -> None:
        """Stops the embedded broker (SIGTERM, SIGKILL after stop_timeout_s) and starts a new one
        on the same port after down_s. It is memory-only: topics, offsets and groups are gone, as
        after a real Tansu restart."""
        if self.broker is None:
            raise RuntimeError("only the embedded broker can be restarted from here")
        port = self.broker.port
        self.broker.stop(stop_timeout_s)
        time.sleep(down_s)
        self.broker = EmbeddedBroker.start(port=port)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM in reverse start order, SIGKILL after grace_s; then the broker. Idempotent."""
        for process in reversed(self.processes):
            process.stop(grace_s)
        self.processes.clear()
        if self.mps is not None:  # after its clients, the rankers, are gone
            self.mps.stop()
            self.mps = None
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        shutil.rmtree(self._run_dir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _spawn(self, name: str, module: str, env: dict[str, str], *args: str) -> ServiceProcess:
        echo = None
        if self._echo is not None:
            sink = self._echo

            def echo(line: str, name: str = name) -> None:
                sink(name, line)

        process = ServiceProcess(module, *args, env=env, echo=echo, name=name)
        self.processes.append(process)
        self._spawned[name] = (module, env, args)
        return process

    def respawn(self, process: ServiceProcess) -> ServiceProcess:
        """Stops the trigger or the router and starts it again with the same arguments, on the
        same gRPC and metrics ports (clients and scrapers keep their addresses): a consumer that
        did not come back to a renewed broker (renew_broker) starts afresh. Its old log records
        stay in `retired`, under the name "<name>-retired-<n>"."""
        ready = {"trigger": "trigger_ready", "router": "router_ready"}.get(process.name)
        if ready is None or process.name not in self._spawned:
            raise ValueError(f"only the trigger and the router are respawned, not {process.name}")
        first = process.wait_event(ready)
        module, env, args = self._spawned[process.name]
        pinned = ["--metrics-port", str(first["metrics_port"])]
        if process.name == "router":
            pinned += ["--port", str(self.router_port)]
        process.stop(5.0)
        self.processes.remove(process)
        name = process.name
        process.name = f"{name}-retired-{sum(1 for p in self.retired if p.name.startswith(name)) + 1}"
        self.retired.append(process)
        fresh = self._spawn(name, module, env, *args, *pinned)  # later flags win
        fresh.wait_event(ready, self.config.startup_timeout_s)
        setattr(self, name, fresh)
        return fresh

    def alive(self) -> Iterator[ServiceProcess]:
        return (p for p in self.processes if p.proc.poll() is None)


def run_until_interrupted(config: StackConfig) -> int:
    """`relaygr up`: start, stream every service's log lines prefixed by its name, stop on Ctrl-C
    or SIGTERM. Exits non-zero if a service dies on its own."""

    out = threading.Lock()

    def say(text: str) -> None:
        with out:  # whole lines only: services log from several threads at once
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def echo(name: str, line: str) -> None:
        say(f"{name:>10} | {line}")

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Stack(config, echo=echo) as stack:
        say(
            f"relaygr up: router on 127.0.0.1:{stack.router_port}, rankers {stack.ranker_targets}, "
            f"kafka {stack.bootstrap} (topic {RETRIEVAL_TOPIC}); Ctrl-C to stop"
        )
        if stack.broker is not None:
            say("relaygr up: the embedded broker is memory-only and keeps every record (it slows as its "
                "partitions fill): for long runs use --kafka with Apache Kafka (compose/)")  # fmt: skip
        while not stop.wait(0.5):
            dead = [p.name for p in stack.processes if p.proc.poll() is not None]
            if dead:
                say(f"relaygr up: {', '.join(dead)} exited; stopping")
                return 1
    return 0
