from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServedBy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVED_BY_UNSPECIFIED: _ClassVar[ServedBy]
    HBM_HIT: _ClassVar[ServedBy]
    INFLIGHT_JOIN: _ClassVar[ServedBy]
    DRAM_RELOAD: _ClassVar[ServedBy]
    FULL_RECOMPUTE: _ClassVar[ServedBy]
    PARTIAL_PREFIX: _ClassVar[ServedBy]
SERVED_BY_UNSPECIFIED: ServedBy
HBM_HIT: ServedBy
INFLIGHT_JOIN: ServedBy
DRAM_RELOAD: ServedBy
FULL_RECOMPUTE: ServedBy
PARTIAL_PREFIX: ServedBy

class Behaviors(_message.Message):
    __slots__ = ("items_le", "actions_le", "timestamps_le")
    ITEMS_LE_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_LE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_LE_FIELD_NUMBER: _ClassVar[int]
    items_le: bytes
    actions_le: bytes
    timestamps_le: bytes
    def __init__(self, items_le: _Optional[bytes] = ..., actions_le: _Optional[bytes] = ..., timestamps_le: _Optional[bytes] = ...) -> None: ...

class UserPrefix(_message.Message):
    __slots__ = ("user_id", "prefix_version", "profile_le", "long_term")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROFILE_LE_FIELD_NUMBER: _ClassVar[int]
    LONG_TERM_FIELD_NUMBER: _ClassVar[int]
    user_id: int
    prefix_version: int
    profile_le: bytes
    long_term: Behaviors
    def __init__(self, user_id: _Optional[int] = ..., prefix_version: _Optional[int] = ..., profile_le: _Optional[bytes] = ..., long_term: _Optional[_Union[Behaviors, _Mapping]] = ...) -> None: ...

class PreInferRequest(_message.Message):
    __slots__ = ("request_id", "prefix", "lease_deadline_unix_ms", "prefetch_only", "user_id", "prefix_version", "prefix_ref", "signal_time_unix_ms", "ranking_deadline_unix_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ONLY_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REF_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RANKING_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefix: UserPrefix
    lease_deadline_unix_ms: int
    prefetch_only: bool
    user_id: int
    prefix_version: int
    prefix_ref: PrefixRef
    signal_time_unix_ms: int
    ranking_deadline_unix_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prefix: _Optional[_Union[UserPrefix, _Mapping]] = ..., lease_deadline_unix_ms: _Optional[int] = ..., prefetch_only: _Optional[bool] = ..., user_id: _Optional[int] = ..., prefix_version: _Optional[int] = ..., prefix_ref: _Optional[_Union[PrefixRef, _Mapping]] = ..., signal_time_unix_ms: _Optional[int] = ..., ranking_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class PreInferReply(_message.Message):
    __slots__ = ("outcome", "reason", "instance_id", "fingerprint")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[PreInferReply.Outcome]
        ACCEPTED: _ClassVar[PreInferReply.Outcome]
        ALREADY_RESIDENT: _ClassVar[PreInferReply.Outcome]
        ALREADY_PRODUCING: _ClassVar[PreInferReply.Outcome]
        RELOAD_SCHEDULED: _ClassVar[PreInferReply.Outcome]
        REFUSED: _ClassVar[PreInferReply.Outcome]
    OUTCOME_UNSPECIFIED: PreInferReply.Outcome
    ACCEPTED: PreInferReply.Outcome
    ALREADY_RESIDENT: PreInferReply.Outcome
    ALREADY_PRODUCING: PreInferReply.Outcome
    RELOAD_SCHEDULED: PreInferReply.Outcome
    REFUSED: PreInferReply.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    outcome: PreInferReply.Outcome
    reason: str
    instance_id: str
    fingerprint: int
    def __init__(self, outcome: _Optional[_Union[PreInferReply.Outcome, str]] = ..., reason: _Optional[str] = ..., instance_id: _Optional[str] = ..., fingerprint: _Optional[int] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("cache_ms", "queue_ms", "compute_ms", "total_ms", "prefix_reused", "batch", "batch_tokens", "launch_ms", "batch_seq", "psi_kept")
    CACHE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REUSED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SEQ_FIELD_NUMBER: _ClassVar[int]
    PSI_KEPT_FIELD_NUMBER: _ClassVar[int]
    cache_ms: float
    queue_ms: float
    compute_ms: float
    total_ms: float
    prefix_reused: float
    batch: int
    batch_tokens: int
    launch_ms: float
    batch_seq: int
    psi_kept: bool
    def __init__(self, cache_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., prefix_reused: _Optional[float] = ..., batch: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., launch_ms: _Optional[float] = ..., batch_seq: _Optional[int] = ..., psi_kept: _Optional[bool] = ...) -> None: ...

class PrefixRef(_message.Message):
    __slots__ = ("length", "fingerprint")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    length: int
    fingerprint: int
    def __init__(self, length: _Optional[int] = ..., fingerprint: _Optional[int] = ...) -> None: ...

class RankRequest(_message.Message):
    __slots__ = ("request_id", "user_id", "prefix_version", "prefix", "prefix_ref", "recent", "candidates_le", "query_time")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REF_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_LE_FIELD_NUMBER: _ClassVar[int]
    QUERY_TIME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    user_id: int
    prefix_version: int
    prefix: UserPrefix
    prefix_ref: PrefixRef
    recent: Behaviors
    candidates_le: bytes
    query_time: int
    def __init__(self, request_id: _Optional[str] = ..., user_id: _Optional[int] = ..., prefix_version: _Optional[int] = ..., prefix: _Optional[_Union[UserPrefix, _Mapping]] = ..., prefix_ref: _Optional[_Union[PrefixRef, _Mapping]] = ..., recent: _Optional[_Union[Behaviors, _Mapping]] = ..., candidates_le: _Optional[bytes] = ..., query_time: _Optional[int] = ...) -> None: ...

class RankReply(_message.Message):
    __slots__ = ("scores", "served_by", "timings", "model_version", "instance_id")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    served_by: ServedBy
    timings: StageTimings
    model_version: str
    instance_id: str
    def __init__(self, scores: _Optional[_Iterable[float]] = ..., served_by: _Optional[_Union[ServedBy, str]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., model_version: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LatencySample(_message.Message):
    __slots__ = ("prefix_len", "tokens", "batch", "compute_ms", "full", "seq")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    tokens: int
    batch: int
    compute_ms: float
    full: bool
    seq: int
    def __init__(self, prefix_len: _Optional[int] = ..., tokens: _Optional[int] = ..., batch: _Optional[int] = ..., compute_ms: _Optional[float] = ..., full: _Optional[bool] = ..., seq: _Optional[int] = ...) -> None: ...

class PreinferSample(_message.Message):
    __slots__ = ("prefix_len", "device_ms", "seq")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    device_ms: float
    seq: int
    def __init__(self, prefix_len: _Optional[int] = ..., device_ms: _Optional[float] = ..., seq: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("instance_id", "model_version", "hbm_budget_bytes", "hbm_resident_bytes", "hbm_leased_bytes", "preinfer_backlog", "rank_queue_depth", "preinfers_refused", "rank_p50_ms", "rank_p99_ms", "recent_batches", "expander_connected", "psi_bytes_per_token", "demotions", "reloads", "hbm_evictable_bytes", "psi_produced", "psi_expired", "lead_time_p50_ms", "hbm_hits", "hbm_misses", "prefix_content_mismatches", "recent_preinfers", "hbm_evictions", "hbm_released", "prefetches_issued", "prefetches_used", "prefetches_wasted", "prefetches_failed", "demotion_lag_p99_ms", "hbm_evicted_undemoted", "ranking_psi_min_tokens", "psi_from_rankings", "device_busy", "signal_trip_p90_ms", "preinfer_due_in_ms", "preinfer_plan", "host_ms_per_request")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HBM_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HBM_RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HBM_LEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREINFER_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    RANK_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PREINFERS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    RANK_P50_MS_FIELD_NUMBER: _ClassVar[int]
    RANK_P99_MS_FIELD_NUMBER: _ClassVar[int]
    RECENT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    EXPANDER_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    PSI_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    RELOADS_FIELD_NUMBER: _ClassVar[int]
    HBM_EVICTABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PSI_PRODUCED_FIELD_NUMBER: _ClassVar[int]
    PSI_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    LEAD_TIME_P50_MS_FIELD_NUMBER: _ClassVar[int]
    HBM_HITS_FIELD_NUMBER: _ClassVar[int]
    HBM_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CONTENT_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    RECENT_PREINFERS_FIELD_NUMBER: _ClassVar[int]
    HBM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HBM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_ISSUED_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_USED_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_WASTED_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FAILED_FIELD_NUMBER: _ClassVar[int]
    DEMOTION_LAG_P99_MS_FIELD_NUMBER: _ClassVar[int]
    HBM_EVICTED_UNDEMOTED_FIELD_NUMBER: _ClassVar[int]
    RANKING_PSI_MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PSI_FROM_RANKINGS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BUSY_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_TRIP_P90_MS_FIELD_NUMBER: _ClassVar[int]
    PREINFER_DUE_IN_MS_FIELD_NUMBER: _ClassVar[int]
    PREINFER_PLAN_FIELD_NUMBER: _ClassVar[int]
    HOST_MS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model_version: str
    hbm_budget_bytes: int
    hbm_resident_bytes: int
    hbm_leased_bytes: int
    preinfer_backlog: int
    rank_queue_depth: int
    preinfers_refused: int
    rank_p50_ms: float
    rank_p99_ms: float
    recent_batches: _containers.RepeatedCompositeFieldContainer[LatencySample]
    expander_connected: bool
    psi_bytes_per_token: int
    demotions: int
    reloads: int
    hbm_evictable_bytes: int
    psi_produced: int
    psi_expired: int
    lead_time_p50_ms: float
    hbm_hits: int
    hbm_misses: int
    prefix_content_mismatches: int
    recent_preinfers: _containers.RepeatedCompositeFieldContainer[PreinferSample]
    hbm_evictions: int
    hbm_released: int
    prefetches_issued: int
    prefetches_used: int
    prefetches_wasted: int
    prefetches_failed: int
    demotion_lag_p99_ms: float
    hbm_evicted_undemoted: int
    ranking_psi_min_tokens: int
    psi_from_rankings: int
    device_busy: float
    signal_trip_p90_ms: float
    preinfer_due_in_ms: _containers.RepeatedScalarFieldContainer[float]
    preinfer_plan: _containers.RepeatedCompositeFieldContainer[PreinferSample]
    host_ms_per_request: float
    def __init__(self, instance_id: _Optional[str] = ..., model_version: _Optional[str] = ..., hbm_budget_bytes: _Optional[int] = ..., hbm_resident_bytes: _Optional[int] = ..., hbm_leased_bytes: _Optional[int] = ..., preinfer_backlog: _Optional[int] = ..., rank_queue_depth: _Optional[int] = ..., preinfers_refused: _Optional[int] = ..., rank_p50_ms: _Optional[float] = ..., rank_p99_ms: _Optional[float] = ..., recent_batches: _Optional[_Iterable[_Union[LatencySample, _Mapping]]] = ..., expander_connected: _Optional[bool] = ..., psi_bytes_per_token: _Optional[int] = ..., demotions: _Optional[int] = ..., reloads: _Optional[int] = ..., hbm_evictable_bytes: _Optional[int] = ..., psi_produced: _Optional[int] = ..., psi_expired: _Optional[int] = ..., lead_time_p50_ms: _Optional[float] = ..., hbm_hits: _Optional[int] = ..., hbm_misses: _Optional[int] = ..., prefix_content_mismatches: _Optional[int] = ..., recent_preinfers: _Optional[_Iterable[_Union[PreinferSample, _Mapping]]] = ..., hbm_evictions: _Optional[int] = ..., hbm_released: _Optional[int] = ..., prefetches_issued: _Optional[int] = ..., prefetches_used: _Optional[int] = ..., prefetches_wasted: _Optional[int] = ..., prefetches_failed: _Optional[int] = ..., demotion_lag_p99_ms: _Optional[float] = ..., hbm_evicted_undemoted: _Optional[int] = ..., ranking_psi_min_tokens: _Optional[int] = ..., psi_from_rankings: _Optional[int] = ..., device_busy: _Optional[float] = ..., signal_trip_p90_ms: _Optional[float] = ..., preinfer_due_in_ms: _Optional[_Iterable[float]] = ..., preinfer_plan: _Optional[_Iterable[_Union[PreinferSample, _Mapping]]] = ..., host_ms_per_request: _Optional[float] = ...) -> None: ...
