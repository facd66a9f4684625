"""The trigger on shared.lifecycle.Lifecycle, against the embedded broker and a CPU ranker: `run`
returns 0 when asked to stop, the first failed background task stops it with 1 (after the batch in
hand and a close), and an admitted event whose ranking deadline is far off reserves its psi in the
ledger (and asks the ranker) for at most RELAYGR_MAX_LEASE_MS."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.trigger.config import TriggerConfig
from services.trigger.events import EventMeta
from services.trigger.service import TriggerService
from shared.config import ConfigError, load_config
from shared.protos import events_pb2 as ev
from tests.integration.test_trigger_poison import (  # the module's broker and ranker fixtures too
    BOUND_S,
    admitted,
    broker,  # noqa: F401
    event,
    eventually,
    publish,
    ranker,  # noqa: F401
    start_trigger,
    topics,
)

pytestmark = pytest.mark.integration


def config(broker_bootstrap: str, *flags: str) -> TriggerConfig:
    retrieval, signals, dlq, group = topics()
    return load_config(TriggerConfig, ["--bootstrap", broker_bootstrap, "--retrieval-topic", retrieval,
                                       "--signal-topic", signals, "--dlq-topic", dlq, "--group-id", group,
                                       "--topic-partitions", "1", "--policy", "off", *flags])  # fmt: skip


async def serving(trigger: TriggerService) -> bool:
    return "consume" in trigger._tasks


async def test_run_returns_0_when_asked_to_stop(broker):  # noqa: F811
    trigger = TriggerService(config(broker.bootstrap))
    runner = asyncio.create_task(trigger.run(install_signals=False))
    await eventually(lambda: serving(trigger), "the trigger serves")
    trigger.life.request_stop("test")
    assert await asyncio.wait_for(runner, BOUND_S) == 0
    assert trigger._tasks["consume"].done()
    assert trigger.life.failure is None


async def test_a_failed_background_task_stops_the_trigger_with_status_1(broker):  # noqa: F811
    trigger = TriggerService(config(broker.bootstrap))
    runner = asyncio.create_task(trigger.run(install_signals=False))
    await eventually(lambda: serving(trigger), "the trigger serves")

    async def dies() -> None:
        raise RuntimeError("the stats poller's view of the fleet is gone")

    trigger._spawn(dies(), "probe")  # any task spawned through the lifecycle, as the poller is
    assert await asyncio.wait_for(runner, BOUND_S) == 1
    assert trigger.life.failure is not None
    assert "the stats poller's view of the fleet is gone" in trigger.life.failure
    assert trigger._tasks["consume"].done()  # intake stopped, the loop finished, then close
    assert trigger._closed


def test_lease_is_the_deadline_plus_slack_capped_at_the_max_lease(broker):  # noqa: F811
    trigger = TriggerService(config(broker.bootstrap, "--max-lease-ms", "5000", "--lease-slack-ms", "500"))
    now = 1_000_000
    near = EventMeta("r1", 1, 1, 100, ranking_deadline_unix_ms=now + 1000)
    far = EventMeta("r2", 1, 1, 100, ranking_deadline_unix_ms=now + 3_600_000)
    assert trigger.lease_deadline_unix_ms(near, now) == now + 1500
    assert trigger.lease_deadline_unix_ms(far, now) == now + 5000
    with pytest.raises(
        ConfigError, match="RELAYGR_TRIGGER_LEASE_SLACK_MS must be below RELAYGR_MAX_LEASE_MS"
    ):
        config(broker.bootstrap, "--max-lease-ms", "500", "--lease-slack-ms", "500")


async def test_an_event_due_in_an_hour_reserves_its_psi_for_at_most_the_max_lease(broker, ranker):  # noqa: F811
    names = topics()
    trigger = await start_trigger(broker, ranker, "--max-lease-ms", "2000", names=names)
    try:
        message = ev.RetrievalEvent.FromString(event(7, "far-1", 100, seed=7))
        message.ranking_deadline_unix_ms = int(time.time() * 1e3) + 3_600_000  # due in an hour
        await publish(broker, names[0], [(b"7", message.SerializeToString())])
        await eventually(lambda: _true(admitted(trigger) == 1), "the event is admitted")
        (ledger,) = trigger.ledgers.values()
        key = (7, message.prefix_version)
        assert ledger.is_admitted(key, time.monotonic())
        # Reserved until at most 2 s (the max lease) after its admission, not for the hour.
        assert not ledger.is_admitted(key, time.monotonic() + 2.0)
    finally:
        await trigger.shutdown()


async def _true(value: bool) -> bool:
    return value
