"""The trigger's validation of retrieval records: every failure dead-lettered with a precise reason,
whatever the admission decision; the size limits agree end to end."""

from __future__ import annotations

import time

import numpy as np
import pytest
from aiokafka import ConsumerRecord

from services.ranker.wire import checked_prefix
from services.trigger.admission import OfferedLoad
from services.trigger.config import TriggerConfig
from services.trigger.delivery import Kind
from services.trigger.events import (
    EventError,
    check_key,
    locate_wire_fault,
    parse_event,
    parse_record,
    signal_size_bound,
)
from services.trigger.service import TriggerService
from shared.config import ConfigError, load_config
from shared.dlq import read_dead_letter
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2 as pb
from shared.wire import DEFAULT_MAX_RECORD_BYTES, MAX_TIMESTAMP, RequestLimits, encode, prefix_message

LIMITS = RequestLimits()
USER = 42


def make_event(tokens: int = 8, user: int = USER, profile: int = 2) -> ev.RetrievalEvent:
    rng = np.random.default_rng(tokens)
    prefix = prefix_message(user, 3, rng.integers(0, 100, profile), rng.integers(0, 10**6, tokens),
                            rng.integers(0, 4, tokens), rng.integers(10**9, 2 * 10**9, tokens))  # fmt: skip
    return ev.RetrievalEvent(schema_version=1, request_id="req", event_time_unix_ms=int(time.time() * 1e3),
                             user_id=user, prefix_version=3, prefix_len=tokens + profile, prefix=prefix,
                             ranking_deadline_unix_ms=int(time.time() * 1e3) + 60_000)  # fmt: skip


def reason(e: ev.RetrievalEvent, key: bytes | None = str(USER).encode()) -> str:
    with pytest.raises(EventError) as caught:
        parse_record(key, e.SerializeToString(), LIMITS)
    return str(caught.value)


def test_a_valid_event_and_its_key():
    meta, _ = parse_record(b"42", make_event().SerializeToString(), LIMITS)
    assert (meta.user_id, meta.prefix_version, meta.prefix_len) == (USER, 3, 10)


def test_empty_value_and_tombstone_have_their_own_reasons():
    with pytest.raises(EventError, match=r"^tombstone: the record has no value \(null\)$"):
        parse_event(None, LIMITS)
    with pytest.raises(EventError, match=r"^empty value: 0 bytes is not a RetrievalEvent$"):
        parse_event(b"", LIMITS)


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b"\x08", "at byte 1 (schema_version): truncated varint"),
        (b"\x08\x01\x3a\x10abc", "at byte 2 (prefix): length 16 runs past the end (3 bytes left)"),
        (b"\x12\x02\xff\xfe", "at byte 2 (request_id): invalid UTF-8"),
        (b"\x3a\x04\x1a\x05ab", "at byte 2 (prefix.profile_le): length 5 runs past the end (2 bytes left)"),
        (b"\x0f", "at byte 0 (schema_version): invalid wire type 7"),
        (b"\x19\x01\x02", "at byte 0 (event_time_unix_ms): 8-byte value truncated (2 bytes left)"),
    ],
)
def test_decode_errors_say_where(raw, where):
    with pytest.raises(EventError) as caught:
        parse_event(raw, LIMITS)
    assert str(caught.value) == f"not a RetrievalEvent: {where}"


def test_the_locator_walks_well_formed_messages_whole():
    raw = make_event().SerializeToString()
    assert locate_wire_fault(raw, ev.RetrievalEvent.DESCRIPTOR) == (
        "the wire format is well formed, yet protobuf refused it"
    )


def test_the_key_is_the_user_id_in_decimal_ascii():
    check_key(b"42", 42)
    with pytest.raises(
        EventError, match=r"^null key: retrieval events are keyed by user id \(expected b'42'\)$"
    ):
        check_key(None, 42)
    with pytest.raises(EventError, match=r"^key 'user-42' is not a decimal user id"):
        check_key(b"user-42", 42)
    with pytest.raises(EventError, match=r"^key '43' is not the event's user_id 42$"):
        check_key(b"43", 42)
    with pytest.raises(EventError, match=r"^key '042' is not the event's user_id 42$"):
        check_key(b"042", 42)
    assert "key '\\xff" in reason(make_event(), key=b"\xff\xfe")
    assert reason(make_event(), key=None).startswith("null key")


def _broken(field: str, value: object) -> ev.RetrievalEvent:
    e = make_event()
    target = e.prefix.long_term if field in ("items_le", "actions_le", "timestamps_le") else e.prefix
    if field in ("items_le", "actions_le", "timestamps_le", "profile_le"):
        setattr(target, field, value)
    else:
        setattr(e, field, value)
    return e


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("items_le", encode([1, -5, 3, 4, 5, 6, 7, 8]), "prefix.long_term.items: values must be non-negative"),
        ("profile_le", encode([-1, 2]), "prefix.profile: values must be non-negative"),
        ("actions_le", encode([0, 1, 2, -3, 0, 1, 2, 3], np.dtype("<i4")),
         "prefix.long_term.actions: values must be non-negative"),
        ("timestamps_le", encode([1, 2, 3, 4, 5, 6, 7, MAX_TIMESTAMP]),
         f"prefix.long_term.timestamps: values must be below {MAX_TIMESTAMP}"),
        ("timestamps_le", encode([1, 2, 3, 4, 5, 6, 7, -1]), "prefix.long_term.timestamps: values must be non-negative"),
        ("items_le", encode(range(8)) + b"\x01", "prefix.long_term.items: 65 bytes is not a whole number of 8-byte values"),
        ("actions_le", encode(range(7), np.dtype("<i4")),
         "prefix.long_term: 8 items, 7 actions and 8 timestamps must match"),
        ("event_time_unix_ms", -1, "event_time_unix_ms -1 is out of range"),
        ("ranking_deadline_unix_ms", 0, "ranking_deadline_unix_ms is required"),
        ("ranking_deadline_unix_ms", MAX_TIMESTAMP * 1000, f"ranking_deadline_unix_ms {MAX_TIMESTAMP * 1000} is out of range"),
        ("prefix_len", 11, "prefix_len 11 does not match the prefix (10 tokens)"),
        ("schema_version", 2, "unsupported schema_version 2 (expected 1)"),
        ("request_id", "", "request_id is required"),
        ("user_id", 43, "prefix.user_id / prefix_version (42 / 3) must equal the event's (43 / 3)"),
    ],
)  # fmt: skip
def test_each_invalid_field_has_its_reason(field, value, expected):
    assert reason(_broken(field, value), key=b"43" if field == "user_id" else b"42") == expected


def test_token_limits():
    limits = RequestLimits(max_profile_tokens=1, max_prefix_tokens=4)
    with pytest.raises(EventError, match=r"prefix\.profile: 2 values exceeds the limit of 1"):
        parse_event(make_event(tokens=4).SerializeToString(), limits)
    with pytest.raises(EventError, match=r"prefix\.long_term\.items: 5 values exceeds the limit of 4"):
        parse_event(make_event(tokens=5, profile=1).SerializeToString(), limits)


def test_a_signal_at_the_token_limits_fits_the_default_record_limit():
    """The largest valid event yields a signal that fits: the limits in shared/wire.py agree."""
    e = make_event(tokens=LIMITS.max_prefix_tokens, profile=LIMITS.max_profile_tokens)
    raw = e.SerializeToString()
    parse_record(b"42", raw, LIMITS)
    assert LIMITS.max_prefix_wire_bytes == 1_312_768
    assert e.prefix.ByteSize() < LIMITS.max_prefix_wire_bytes + 64
    signal = ev.PreInferSignal(schema_version=1, request_id=e.request_id, signal_time_unix_ms=2**62, prefix=e.prefix,
                               lease_deadline_unix_ms=2**62, expected_instance="x" * 255)  # fmt: skip
    assert len(signal.SerializeToString()) <= signal_size_bound(e, 255)
    assert signal_size_bound(e, 255) < DEFAULT_MAX_RECORD_BYTES - 512


def trigger(*flags: str) -> TriggerService:
    """A trigger that decides without a broker (policy off: every valid event is not at risk)."""
    return TriggerService(load_config(TriggerConfig, ["--policy", "off", "--dlq-topic", "dlq", *flags]))


def record(value: bytes | None, key: bytes | None = b"42", offset: int = 0) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(topic="retrieval", partition=1, offset=offset, timestamp=1, timestamp_type=0, key=key,
                          value=value, checksum=None, serialized_key_size=len(key or b""),
                          serialized_value_size=len(value or b""), headers=[("trace", b"t1")])  # fmt: skip


def test_every_failure_is_dead_lettered_whatever_the_decision():
    service = trigger()
    bad = _broken("items_le", encode([1, -5, 3, 4, 5, 6, 7, 8]))
    out = service._handle(record(bad.SerializeToString()))
    assert out is not None
    assert out.kind is Kind.DEAD_LETTER
    assert (out.topic, out.key, out.value) == ("dlq", b"42", bad.SerializeToString())
    assert service.counts["dead_letter"] == 1
    assert service.counts["not_at_risk"] == 0
    assert service._handle(record(make_event().SerializeToString())) is None  # decided, no output
    assert service.counts["not_at_risk"] == 1


async def with_healthy_ranker(*flags: str) -> TriggerService:
    """A sequence-aware trigger (no broker) whose one ranker, at an address nothing answers,
    is marked up after its membership's first round of checks."""
    service = trigger("--policy", "sequence", "--rankers", "127.0.0.1:1", *flags)
    assert service.membership is not None
    await service.membership.start()
    service.membership._set(service.membership._state["127.0.0.1:1"], True, "test")
    return service


@pytest.mark.parametrize("prefetch", [True, False])
async def test_a_returning_user_not_at_risk_gets_a_prefetch_only_signal(prefetch):
    service = await with_healthy_ranker("--prefetch", str(prefetch).lower())
    try:
        check_prefetch_signal(service, prefetch)
    finally:
        assert service.membership is not None
        await service.membership.close()


def check_prefetch_signal(service: TriggerService, prefetch: bool) -> None:
    raw = make_event().SerializeToString()
    assert service._handle(record(raw)) is None  # a first visit, not at risk: nothing to bring back
    assert service.counts["not_at_risk"] == 1
    out = service._handle(record(raw, offset=1))  # the same user and prefix version again
    if not prefetch:
        assert out is None
        assert service.counts["not_at_risk"] == 2
        return
    assert out is not None
    assert out.kind is Kind.SIGNAL
    signal = ev.PreInferSignal.FromString(out.value)
    assert signal.prefetch_only
    # By reference: the name the ranker computes from the tokens, not the tokens.
    assert not signal.HasField("prefix")
    prefix = checked_prefix(make_event().prefix, LIMITS)
    assert (signal.user_id, signal.prefix_version) == (prefix.user_id, prefix.prefix_version)
    assert (signal.prefix_ref.length, signal.prefix_ref.fingerprint) == (prefix.length, prefix.digest)
    assert len(out.value) < 100
    assert signal.lease_deadline_unix_ms > 0
    assert service.counts["prefetch"] == 1
    # A target whose full rankings keep psi only from 512 tokens: this 10-token prefix has none there.
    keeps = stats_reply([], [], [])
    keeps.ranking_psi_min_tokens = 512
    service._absorb("127.0.0.1:1", keeps)
    assert service._handle(record(raw, offset=2)) is None
    assert service.counts["not_at_risk"] == 2


def test_an_event_whose_signal_would_not_fit_is_refused_up_front():
    service = trigger("--max-record-bytes", str(64 << 10))
    raw = make_event(tokens=4000).SerializeToString()  # ~80 KB
    out = service._handle(record(raw))
    assert out is not None
    assert out.kind is Kind.DEAD_LETTER
    headers = dict(out.headers or [])
    assert headers["relaygr.dlq.reason"].startswith(b"a pre-infer signal for this event would take up to ")
    assert headers["trace"] == b"t1"  # the original headers travel too
    assert service.counts["dead_letter"] == 1


def test_the_dead_letter_reads_back():
    out = trigger()._handle(record(None, offset=9))
    assert out is not None
    letter = read_dead_letter(
        ConsumerRecord(topic="dlq", partition=0, offset=0, timestamp=1, timestamp_type=0, key=out.key, value=out.value,
                       checksum=None, serialized_key_size=2, serialized_value_size=-1, headers=out.headers or [])
    )  # fmt: skip
    assert (letter.reason, letter.source_topic, letter.partition, letter.offset, letter.service) == (
        "tombstone: the record has no value (null)", "retrieval", 1, 9, "trigger"
    )  # fmt: skip
    assert letter.value is None
    assert letter.headers == (("trace", b"t1"),)


def stats_reply(
    full: list[tuple[int, int, float]], cached: list[tuple[int, float]], preinfers: list[tuple[int, float]]
) -> pb.StatsReply:
    """full: (batch, tokens per call, batch ms); cached: (batch, batch ms); preinfers: (prefix, ms)."""
    seq = iter(range(1, 10_000))
    batches = [
        pb.LatencySample(prefix_len=t, tokens=b * t, batch=b, compute_ms=ms, full=True, seq=next(seq))
        for b, t, ms in full
    ]
    batches += [
        pb.LatencySample(tokens=b * 320, batch=b, compute_ms=ms, full=False, seq=next(seq))
        for b, ms in cached
    ]
    return pb.StatsReply(recent_batches=batches, recent_preinfers=[
        pb.PreinferSample(prefix_len=n, device_ms=ms, seq=i + 1) for i, (n, ms) in enumerate(preinfers)])  # fmt: skip


@pytest.mark.parametrize(("rate", "admits"), [(35.0, True), (300.0, True), (800.0, False)])
def test_the_spare_terms_saving_is_weighed_against_the_waits_it_imposes_at_the_instances_rate(rate, admits):
    t = trigger("--policy", "sequence", "--rankers", "127.0.0.1:1")
    # 16384 tokens on an H200: full rankings 18.4 ms, calls against psi 1.9, a whole
    # pre-inference 20 ms: 16.5 ms saved on the call and rate x (18.4^2 - 1.9^2) / 2 of others'
    # waits behind its full ranking, against rate x 20^2 / 2 behind the pre-inference.
    t._absorb("127.0.0.1:1", stats_reply([(1, 16704, 18.4)] * 8, [(1, 1.9)] * 8, [(16384, 20.0)] * 8))
    offered = OfferedLoad(window_s=2.0)
    now = 0.0
    for _ in range(int(rate * 10)):  # ten seconds of events at the rate
        now += 1.0 / rate
        offered.add(now, 18.4)
    assert t.spare_shortens(16704)
    assert t.spare_outweighs_waits(16384, 16704, "127.0.0.1:1", offered, now) is admits
    assert trigger("--policy", "sequence", "--rankers", "127.0.0.1:1").config.spare_prices_waits
    off = trigger("--policy", "sequence", "--rankers", "127.0.0.1:1", "--spare-prices-waits", "false")
    assert not off.config.spare_prices_waits


def test_the_spare_term_waits_for_the_host_where_a_host_bound_is_set():
    """--spare-host-max: with the device idle and a saving worth the pre-inference, the spare
    term still needs the ranker's host to have room (its host ms per request at its call rate);
    0.6 of a core by default (k28b), 0 turns the test off, and a flag with a wrong value stops
    the trigger at start-up."""
    target = "127.0.0.1:1"
    reply = stats_reply([(1, 16704, 18.4)] * 8, [(1, 1.9)] * 8, [(16384, 20.0)] * 8)
    reply.device_busy = 0.2
    reply.host_ms_per_request = 3.0
    offered = OfferedLoad(window_s=2.0)
    now = 0.0
    for _ in range(3000):  # ten seconds of events at 300 a second: 0.9 of a core
        now += 1.0 / 300.0
        offered.add(now, 18.4)
    bounded = trigger("--policy", "sequence", "--rankers", target)
    off = trigger("--policy", "sequence", "--rankers", target, "--spare-host-max", "0")
    for t in (bounded, off):
        t._absorb(target, reply)
        assert t.has_spare(target)  # the device has room either way
    assert bounded.config.spare_host_max == 0.6
    assert off.host_has_spare(target, offered, now)
    assert not bounded.host_has_spare(target, offered, now)
    quiet = OfferedLoad(window_s=2.0)
    for i in range(100):  # ten seconds at 10 a second: 0.03 of a core
        quiet.add(now + i / 10.0, 18.4)
    assert bounded.host_has_spare(target, quiet, now + 10.0)
    with pytest.raises(ConfigError, match=r"spare_host_max .* must be >= 0"):
        trigger("--policy", "sequence", "--rankers", target, "--spare-host-max", "-1")


def test_the_spare_terms_call_rate_is_the_rankers_own_where_this_trigger_sees_a_share():
    # This trigger routed 35 events a second to the ranker, whose reports count 800 calls a
    # second (other triggers' partitions): the waits are priced at 800.
    t = trigger("--policy", "sequence", "--rankers", "127.0.0.1:1")
    target = "127.0.0.1:1"
    reply = stats_reply([(1, 16704, 18.4)] * 8, [(1, 1.9)] * 8, [(16384, 20.0)] * 8)
    t._absorb(target, reply)
    offered = OfferedLoad(window_s=2.0)
    now = 0.0
    for _ in range(350):
        now += 1.0 / 35.0
        offered.add(now, 18.4)
    assert t.spare_outweighs_waits(16384, 16704, target, offered, now)
    began = time.monotonic()
    for step in range(1, 41):  # ten seconds of reports, 0.25 s apart
        t._absorb_call_rate(target, began + 0.25 * step, 200 * step)
    assert t._call_rate[target] == pytest.approx(800.0, rel=1e-3)
    assert not t.spare_outweighs_waits(16384, 16704, target, offered, now)
    t._absorb_call_rate(target, began + 11.0, 5)  # the ranker restarted: its count went back
    t._absorb_call_rate(target, began + 11.25, 5)
    assert t._call_rate[target] < 800.0


def test_reuse_is_priced_by_the_rankers_measured_work_per_call():
    t = trigger("--policy", "sequence", "--rankers", "127.0.0.1:1")
    # No full ranking measured yet: the FLOPs prior says nothing of fixed costs, never admit on reuse.
    assert not t.reuse_pays(4096, 4416)
    for user in range(300):  # sessions of 3: E[later calls] about 2
        for _ in range(3):
            t.returns.observe((user, 1), 0.0)
    # Full rankings of 4416 tokens, 6 ms each alone, 8 ms for batches of two (4 ms per call);
    # cached calls 1.5 ms per call in batches of 4; a whole pre-inference of 4096 tokens 5 ms.
    t._absorb(
        "127.0.0.1:1", stats_reply([(1, 4416, 6.0), (2, 4416, 8.0)] * 4, [(4, 6.0)] * 4, [(4096, 5.0)] * 5)
    )
    assert t.cached_call_ms() == pytest.approx(1.5)
    assert 4.0 <= t.full_work.full_ms(4416) <= 6.0  # per call: a batch of two took 8 ms, 4 ms a call
    assert t.preinfer_ms(4096) == pytest.approx(5.0, rel=0.01)
    assert t.reuse_pays(4096, 4416)  # 3 x (5 - 1.5) > 5
    # Newer cached batches move the price of a cached call (read once per Stats poll, not per event).
    t._absorb("127.0.0.1:1", stats_reply([], [(4, 12.0)] * 20, []))  # seq 13-20 are new: 3 ms a call
    assert t.cached_call_ms() == pytest.approx(3.0)
    # A target whose full rankings keep psi from 512 tokens on: the later calls read that psi
    # whether or not this prefix is pre-inferred (5 + 3 ms > 4-6 ms); shorter prefixes as before.
    assert t.reuse_pays(4096, 4416, "127.0.0.1:1")  # 3 x (5 - 3) > 5
    keeps = stats_reply([], [], [])
    keeps.ranking_psi_min_tokens = 512
    t._absorb("127.0.0.1:1", keeps)
    assert not t.reuse_pays(4096, 4416, "127.0.0.1:1")
    assert t.reuse_pays(4096, 4416, "127.0.0.1:2")  # another target: nothing reported
    keeps.ranking_psi_min_tokens = 8192
    t._absorb("127.0.0.1:1", keeps)
    assert t.reuse_pays(4096, 4416, "127.0.0.1:1")  # under that target's threshold
    # A pre-inference measured far dearer than the rankings it saves is not worth it.
    t._absorb("127.0.0.1:1", stats_reply([], [], [(4096, 40.0)] * 64))
    assert t.preinfer_ms(4096) > 20.0
    assert not t.reuse_pays(4096, 4416)
    # With the reuse window at 0 the trigger admits by risk only.
    assert not trigger(
        "--policy", "sequence", "--rankers", "127.0.0.1:1", "--reuse-window-s", "0"
    ).reuse_pays(4096, 4416)


def test_reuse_admission_survives_compile_stalls_in_the_first_pre_inferences():
    # A fresh ranker's first pre-inferences on a GPU included compiles seconds long: a price
    # set by them admitted no pre-inference by reuse again, and none came to correct it.
    t = trigger("--policy", "sequence", "--rankers", "127.0.0.1:1")
    for user in range(300):
        for _ in range(3):
            t.returns.observe((user, 1), 0.0)
    full, cached = [(1, 4416, 6.0), (2, 4416, 8.0)] * 4, [(4, 6.0)] * 4
    t._absorb("127.0.0.1:1", stats_reply(full, cached, [(4096, 9000.0), (4000, 12000.0)]))
    assert t.preinfer_ms(4096) == pytest.approx(t.full_work.full_ms(4096))  # too few: the full ranking's
    assert t.reuse_pays(4096, 4416)
    # Once enough are measured, the stalls among them are dropped.
    t._absorb("127.0.0.1:1", stats_reply([], [], [(4096, 5.0), (4096, 5.2), (4096, 4.9), (4096, 5.1)]))
    assert t.preinfer_ms(4096) == pytest.approx(5.05, rel=0.05)
    assert t.reuse_pays(4096, 4416)


def test_before_pre_inferences_are_measured_the_rankers_plan_prices_them():
    # H200, L4096 (k11a): four pre-inferences measured in the warm-up (too few to price by), so a
    # psi was priced as a full ranking of its prefix, every at-risk event "added work", none was
    # admitted, and no measurement came to correct the price. The ranker's own plan prices it.
    t = trigger("--policy", "sequence", "--rankers", "127.0.0.1:1,127.0.0.1:2")
    full, cached = [(1, 4416, 3.3)] * 8, [(2, 2.3)] * 8  # full rankings 3.3 ms, 1.15 ms a call on psi
    t._absorb("127.0.0.1:1", stats_reply(full, cached, [(4096, 4.2)] * 4))
    assert t.preinfer_ms(4096) == pytest.approx(t.full_work.full_ms(4096))  # no plan: the proxy
    assert not t.risk_adds_little(4096, 4416)  # ~3.1 + 1.15 ms > 1.15 x 3.3 ms
    planned = stats_reply([], [], [])
    planned.preinfer_plan.extend(
        pb.PreinferSample(prefix_len=n, device_ms=0.5 + 0.0004 * n)
        for n in (256, 512, 1024, 2048, 4096, 8192)
    )
    t._absorb("127.0.0.1:1", planned)
    assert t.preinfer_ms(4096) == pytest.approx(0.5 + 0.0004 * 4096, rel=0.02)
    assert t.risk_adds_little(4096, 4416)  # 2.14 + 1.15 ms <= 1.15 x 3.3 ms
    # Another ranker that plans dearer psi sets the price (a pre-inference may land there); once
    # it leaves the plans, the cheaper one prices again.
    dearer = stats_reply([], [], [])
    dearer.preinfer_plan.extend(
        pb.PreinferSample(prefix_len=n, device_ms=0.001 * n) for n in (256, 1024, 4096)
    )
    t._absorb("127.0.0.1:2", dearer)
    assert t.preinfer_ms(4096) == pytest.approx(4.096, rel=0.05)
    t._absorb("127.0.0.1:2", stats_reply([], [], []))
    assert t.preinfer_ms(4096) == pytest.approx(2.14, rel=0.02)
    # Measured pre-inferences, once there are enough, price it whatever the plan says.
    t._absorb("127.0.0.1:1", stats_reply([], [], [(4096, 3.0)] * 12))  # seq 5-12 are new
    assert t.preinfer_ms(4096) == pytest.approx(3.0, rel=0.2)


def test_each_request_is_priced_at_what_it_costs_the_rankers_host_too():
    # H200, L4096 (k11e): full ranking 3.3 ms, psi 2.1, a call against psi 1.15 on the device;
    # ~1.3 ms of host CPU a request. By device time a pre-inference for risk adds little (3.25
    # against 3.3 x 1.15); as two requests against one on a host-bound ranker it adds work.
    t = trigger("--policy", "sequence", "--rankers", "127.0.0.1:1,127.0.0.1:2")  # on by default
    planned = stats_reply([(1, 4416, 3.3)] * 8, [(2, 2.3)] * 8, [])
    planned.preinfer_plan.extend(
        pb.PreinferSample(prefix_len=n, device_ms=0.000513 * n) for n in (1024, 2048, 4096)
    )
    t._absorb("127.0.0.1:1", planned)
    assert t.risk_adds_little(4096, 4416, "127.0.0.1:1")  # no host figure yet: device time alone
    hosted = stats_reply([], [], [])
    hosted.preinfer_plan.extend(planned.preinfer_plan)  # every reply of a calibrated ranker has it
    hosted.host_ms_per_request = 1.3
    t._absorb("127.0.0.1:1", hosted)
    assert t.host_ms("127.0.0.1:1") == 1.3
    assert not t.risk_adds_little(4096, 4416, "127.0.0.1:1")
    assert t.risk_adds_little(4096, 4416, "127.0.0.1:2")  # another ranker: none reported
    # A figure of 0 (too few requests in its window) keeps the last one.
    hosted.host_ms_per_request = 0.0
    t._absorb("127.0.0.1:1", hosted)
    assert t.host_ms("127.0.0.1:1") == 1.3
    # Reuse: the signal is one more request to pay for from the calls' savings.
    for user in range(300):  # sessions of 3: about 2 later calls
        for _ in range(3):
            t.returns.observe((user, 1), 0.0)
    expected = t.returns.expected_later()
    saving, psi = (1 + expected) * (3.3 - 1.15), t.preinfer_ms(4096)
    assert saving > psi  # by device time it pays
    assert t.reuse_pays(4096, 4416, "127.0.0.1:2")
    assert t.reuse_pays(4096, 4416, "127.0.0.1:1") == (saving > psi + 1.3)
    # Off, the host's figure is reported and logged, not priced.
    plain = trigger("--policy", "sequence", "--rankers", "127.0.0.1:1", "--host-cost", "false")
    plain._absorb("127.0.0.1:1", planned)
    hosted.host_ms_per_request = 1.3
    plain._absorb("127.0.0.1:1", hosted)
    assert plain._host_ms["127.0.0.1:1"] == 1.3  # kept for its log line
    assert plain.host_ms("127.0.0.1:1") == 0.0
    assert plain.risk_adds_little(4096, 4416, "127.0.0.1:1")


async def test_too_late_uses_the_signal_trip_the_rankers_measure():
    service = await with_healthy_ranker()
    try:
        # A first-seen user the spare term admits: full rankings of ~4416 tokens 8 ms, calls
        # against psi 1.5 ms (6.5 ms saved, over a tenth of the SLO), a pre-inference 5 ms, the
        # device 10% busy.
        reply = stats_reply([(1, 4416, 8.0)] * 8, [(1, 1.5)] * 8, [(4096, 5.0)] * 8)
        reply.device_busy = 0.1
        service._absorb("127.0.0.1:1", reply)
        assert service.signal_trip_s("127.0.0.1:1") == pytest.approx(0.05)  # nothing measured yet

        def event(user: int, lead_ms: int) -> bytes:
            e = make_event(tokens=4000, user=user)
            e.ranking_deadline_unix_ms = int(time.time() * 1e3) + int(service.config.slo_ms) + lead_ms
            return e.SerializeToString()

        # Its ranking call comes 45 ms from now: under the 50 ms assumed before any report.
        assert service._handle(record(event(1, 45), key=b"1")) is None
        assert service.counts["too_late"] == 1
        # The rankers measure the trip at 8 ms: the same lead now leaves time to start.
        reply.signal_trip_p90_ms = 8.0
        service._absorb("127.0.0.1:1", reply)
        assert service.signal_trip_s("127.0.0.1:1") == pytest.approx(0.008)
        raw = event(2, 45)
        out = service._handle(record(raw, key=b"2"))
        assert out is not None
        assert out.kind is Kind.SIGNAL
        signal = ev.PreInferSignal.FromString(out.value)
        assert signal.signal_time_unix_ms > 0
        # The ranker builds the psi needed soonest first: the signal says when its call is due.
        assert (
            signal.ranking_deadline_unix_ms == ev.RetrievalEvent.FromString(raw).ranking_deadline_unix_ms > 0
        )
        # A measured trip under the floor counts as the floor; a report without one keeps it.
        reply.signal_trip_p90_ms = 1.0
        service._absorb("127.0.0.1:1", reply)
        assert service.signal_trip_s("127.0.0.1:1") == pytest.approx(0.005)
        reply.signal_trip_p90_ms = 0.0
        service._absorb("127.0.0.1:1", reply)
        assert service.signal_trip_s("127.0.0.1:1") == pytest.approx(0.005)
        # A call due before even the measured trip is still too late.
        assert service._handle(record(event(3, 2), key=b"3")) is None
        assert service.counts["too_late"] == 2
        # Ten pre-inferences queued there, all due after this event's call (the ranker lists
        # their deadlines): built after it, none is ahead.
        reply.signal_trip_p90_ms = 8.0
        reply.preinfer_backlog = 10
        slo_ms = service.config.slo_ms
        reply.preinfer_due_in_ms[:] = [slo_ms + 500.0] * 10
        service._absorb("127.0.0.1:1", reply)
        assert service._handle(record(event(4, 45), key=b"4")) is not None
        # ... all due before it: 10 x 5 ms of pre-inference and the trip do not fit 45 ms.
        reply.preinfer_due_in_ms[:] = [slo_ms + 10.0] * 10
        service._absorb("127.0.0.1:1", reply)
        assert service._handle(record(event(5, 45), key=b"5")) is None
        assert service.counts["too_late"] == 3
    finally:
        assert service.membership is not None
        await service.membership.close()


@pytest.mark.parametrize("min_saving", ["0.1", "0"])
async def test_the_spare_term_needs_a_saving_that_counts_against_the_slo(min_saving):
    service = await with_healthy_ranker("--spare-min-saving", min_saving)
    try:
        # 4096 tokens on an H200 (k10c): full rankings 2.8 ms, calls against psi 1.3, the device
        # idle. The call against psi is under half the full ranking, but saves 3% of the SLO.
        reply = stats_reply([(1, 4416, 2.8)] * 8, [(1, 1.3)] * 8, [(4096, 2.0)] * 8)
        reply.device_busy = 0.1
        service._absorb("127.0.0.1:1", reply)
        assert service.has_spare("127.0.0.1:1")
        assert service.spare_shortens(4416) is (min_saving == "0")
        # The same device at 16384 tokens: a full ranking's 18 ms are worth moving off the path.
        service._absorb("127.0.0.1:1", stats_reply([(1, 16704, 18.4)] * 8, [], []))
        assert service.spare_shortens(16704)
    finally:
        assert service.membership is not None
        await service.membership.close()
