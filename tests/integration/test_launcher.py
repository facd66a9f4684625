"""`relaygr up`: the whole stack from one command, and nothing left behind however it ends:
no process, descriptor, thread, /dev/shm file or unix socket."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from relaygr.harness import scrape_metrics
from relaygr.launcher import (
    EMBEDDED_REQUEST_TIMEOUT_MS,
    PROBE,
    REQUEST_TIMEOUT_ENV,
    RETRIEVAL_TOPIC,
    Stack,
    StackConfig,
)
from relaygr.processes import REPO
from shared.kafka import KafkaSettings, make_producer
from shared.protos import ranker_pb2_grpc as pb_grpc
from tests.rankers import rank_request, users
from tests.waiting import eventually

pytestmark = pytest.mark.integration


def children_of(pid: int) -> list[int]:
    """Services started by a launcher: they carry RELAYGR_DIE_WITH_PARENT=<its pid>."""
    found = []
    marker = f"RELAYGR_DIE_WITH_PARENT={pid}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def start_up(*extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "relaygr.cli", "up", "--rankers", "1", *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        if line.startswith("relaygr up: router on "):
            return proc, line.split("router on ")[1].split(",")[0]
        assert time.monotonic() < deadline, "relaygr up did not come up"
    raise AssertionError(f"relaygr up exited early with {proc.wait()}")


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def test_up_serves_and_ctrl_c_leaves_nothing_behind():
    shm_before = set(os.listdir("/dev/shm"))
    proc, router = start_up()
    try:
        services = children_of(proc.pid)
        assert len(services) == 4  # expander, ranker, router, trigger (the broker runs under a shim)
        prefixes, suffixes = users(1, 1, prefix_len=100)
        with grpc.insecure_channel(router) as channel:
            reply = channel.unary_unary(
                "/relaygr.v1.Ranker/Rank",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=lambda b: b,
            )(rank_request(prefixes[0], suffixes[0], "up"), timeout=60)
        assert reply
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert wait_gone(services) == []
    finally:
        if proc.poll() is None:
            proc.kill()
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_killed_launcher_leaves_no_orphans():
    proc, _ = start_up("--no-expander")
    services = children_of(proc.pid)
    assert services
    proc.kill()
    proc.wait()
    assert wait_gone(services) == []


# ---------------------------------------------------------------------- a Stack in this process


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what they point at."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the descriptor listdir itself used, closed by now
            continue
    return out


def children(pid: int) -> set[int]:
    """Direct children of pid, zombies included (an unreaped child is a leak too)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in children(todo.pop()) - found:
            found.add(child)
            todo.append(child)
    return found


def unix_sockets() -> dict[str, str]:
    """Every unix socket on the host with a path: inode -> path (/proc/net/unix)."""
    out = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[7].startswith("/"):
            out[parts[6]] = parts[7]
    return out


def held_by(pids: set[int]) -> tuple[set[str], set[str]]:
    """(unix socket paths, /dev/shm paths) that these processes hold open or mapped now."""
    paths = unix_sockets()
    sockets, shm = set(), set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in paths:
                    sockets.add(paths[target[8:-1]])
                elif target.startswith("/dev/shm/"):
                    shm.add(target.removesuffix(" (deleted)"))
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    shm.add(line[line.index("/dev/shm/") :].removesuffix(" (deleted)"))
        except OSError:
            continue  # exited meanwhile
    return sockets, shm


async def _use(stack: Stack) -> None:
    """What a client does (as the benchmarks do): a retrieval event through Kafka, a ranking
    call through the router."""
    producer = make_producer(KafkaSettings(bootstrap=stack.bootstrap))
    await producer.start()
    try:
        await producer.send_and_wait(RETRIEVAL_TOPIC, b"not an event", key=b"1")  # dead-lettered
    finally:
        await producer.stop()
    await _ranks_through_the_router(stack, "hygiene")


async def _ranks_through_the_router(stack: Stack, request_id: str) -> None:
    prefixes, suffixes = users(2, 1, prefix_len=100)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.router_port}") as channel:
        reply = await pb_grpc.RankerStub(channel).Rank(
            rank_request(prefixes[0], suffixes[0], request_id), timeout=60
        )
    assert reply.scores


def test_a_stopped_stack_leaves_no_descriptor_process_thread_shm_file_or_socket():
    """Start, use and stop the whole stack in this process (as the integration tests and the
    benchmarks do), then compare with before, while still holding the Stack (what it refers to
    must not keep anything open).

    No descriptor is exempt. Checked for ones a library creates on first use and keeps for the
    life of the process (gRPC's pollers, asyncio's self-pipe, aiokafka): with this test's first
    use of grpc.aio and aiokafka in a fresh interpreter, none outlives its channel, event loop or
    client. The descriptors pytest itself holds (output capture) are open before and after."""
    pid = os.getpid()
    fds_before, threads_before = open_fds(), set(threading.enumerate())
    children_before, shm_before = children(pid), set(os.listdir("/dev/shm"))
    stack = Stack(StackConfig(rankers=1))
    with stack:
        asyncio.run(_use(stack))
        ours = descendants(pid) - children_before
        sockets, shm = held_by(ours)
        run_dir = os.path.dirname(stack.expander_socket)
        assert len(ours) >= 5  # broker, expander, ranker, router, trigger
        assert stack.expander_socket in sockets  # what is checked below was seen in use
    assert sorted(p for p in ours if Path(f"/proc/{p}").exists()) == []
    assert children(pid) == children_before  # reaped: no zombies either
    live = set(unix_sockets().values())
    assert sorted(sockets & live) == []  # nobody listens on our socket paths any more
    assert sorted(p for p in sockets | shm if os.path.exists(p)) == []
    assert not os.path.exists(run_dir)
    assert set(os.listdir("/dev/shm")) <= shm_before
    assert [t.name for t in threading.enumerate() if t not in threads_before] == []
    leaked = {fd: target for fd, target in open_fds().items() if fds_before.get(fd) != target}
    assert leaked == {}


async def _dead_letters(stack: Stack) -> float:
    assert stack.trigger is not None
    port = int(stack.trigger.wait_event("trigger_ready")["metrics_port"])
    return (await asyncio.to_thread(scrape_metrics, port)).get("relaygr_trigger_dead_letters_total", 0.0)


async def _values_in(stack: Stack, topic: str, partitions: set[int]) -> list[bytes]:
    """Every record's value in these partitions of the topic, from the first."""
    reader = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap, enable_auto_commit=False)
    await reader.start()
    try:
        tps = [TopicPartition(topic, p) for p in partitions]
        reader.assign(tps)
        await reader.seek_to_beginning(*tps)
        ends = await reader.end_offsets(tps)
        values: list[bytes] = []
        deadline = time.monotonic() + 20.0
        while len(values) < sum(ends.values()) and time.monotonic() < deadline:
            for records in (await reader.getmany(timeout_ms=500)).values():
                values += [r.value or b"" for r in records]
        assert len(values) == sum(ends.values()), "not every record was read back"
    finally:
        await reader.stop()
    return values


async def _renewed_broker_serves(stack: Stack) -> None:
    for renewal in range(2):
        assert await stack.renew_broker()
        producer = make_producer(KafkaSettings(bootstrap=stack.bootstrap))
        await producer.start()
        try:
            # The stack's topics were made again before renew_broker returned, as configured
            # (a producer that came first would have made a topic of one partition).
            partitions = await producer.partitions_for(RETRIEVAL_TOPIC)
            assert len(partitions) == stack.config.partitions
            # Empty but for renew_broker's probes, one a partition (the trigger counted each
            # before renew_broker returned; a second check, after a consumer that was slow to
            # rejoin was restarted, sends them again): the record of the renewal before is not in it.
            values = await _values_in(stack, RETRIEVAL_TOPIC, partitions)
            assert len(values) in (len(partitions), 2 * len(partitions))
            assert set(values) == {PROBE}
            before = await _dead_letters(stack)
            await producer.send_and_wait(RETRIEVAL_TOPIC, b"not an event", key=b"1")
        finally:
            await producer.stop()

        async def decided(before: float = before) -> bool:
            return await _dead_letters(stack) > before

        # The trigger's consumer joined the new broker's group and read the new topic.
        await eventually(decided, f"the trigger reads the broker renewed {renewal + 1} time(s)", bound_s=60)
    await _ranks_through_the_router(stack, "renewed")


def test_a_renewed_broker_is_empty_has_the_stacks_topics_and_the_services_use_it():
    with Stack(StackConfig(rankers=1)) as stack:
        assert stack.trigger is not None
        assert stack.router is not None
        for service in (stack.trigger, stack.router):  # a request to a killed broker is not awaited 40 s
            environ = Path(f"/proc/{service.proc.pid}/environ").read_bytes().split(b"\0")
            assert f"{REQUEST_TIMEOUT_ENV}={EMBEDDED_REQUEST_TIMEOUT_MS}".encode() in environ
        asyncio.run(_renewed_broker_serves(stack))


def test_a_service_that_does_not_read_the_renewed_broker_is_restarted_on_its_ports():
    # As the H200's trigger in k16e: after one renewal it never read the broker again. Here the
    # trigger is frozen (SIGSTOP) across a renewal: renew_broker restarts it on the same metrics
    # port, keeps the first process's log, and the stack ranks and decides as before.
    with Stack(StackConfig(rankers=1)) as stack:
        assert stack.trigger is not None
        frozen = stack.trigger
        metrics_port = int(frozen.wait_event("trigger_ready")["metrics_port"])
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            assert asyncio.run(stack.renew_broker(confirm_s=4.0)) is True
        finally:
            if frozen.proc.poll() is None:
                os.kill(frozen.proc.pid, signal.SIGCONT)
        assert stack.trigger is not frozen
        assert frozen.proc.poll() is not None  # stopped, not left behind
        assert [p.name for p in stack.retired] == ["trigger-retired-1"]
        assert frozen not in stack.processes
        assert stack.trigger in stack.processes
        assert int(stack.trigger.wait_event("trigger_ready")["metrics_port"]) == metrics_port
        assert any(r.get("event") == "trigger_ready" for r in frozen.records())  # its log kept
        # The router, respawned by hand, keeps the address its clients were given.
        assert stack.router is not None
        router_port = stack.router_port
        stack.respawn(stack.router)
        assert int(stack.router.wait_event("router_ready")["port"]) == router_port
        with pytest.raises(ValueError, match="only the trigger and the router"):
            stack.respawn(stack.rankers[0])

        async def after() -> None:
            before = await _dead_letters(stack)
            producer = make_producer(KafkaSettings(bootstrap=stack.bootstrap))
            await producer.start()
            try:
                await producer.send_and_wait(RETRIEVAL_TOPIC, b"not an event", key=b"2")
            finally:
                await producer.stop()

            async def decided() -> bool:
                return await _dead_letters(stack) > before

            await eventually(decided, "the restarted trigger reads the renewed broker", bound_s=60)
            await _ranks_through_the_router(stack, "respawned")

        asyncio.run(after())


def test_a_stack_on_an_external_broker_is_not_renewed():
    stack = Stack(StackConfig(rankers=1, kafka_bootstrap="127.0.0.1:1"))
    assert asyncio.run(stack.renew_broker()) is False
