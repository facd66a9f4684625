from shared.protos import ranker_pb2 as _ranker_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RetrievalEvent(_message.Message):
    __slots__ = ("schema_version", "request_id", "event_time_unix_ms", "user_id", "prefix_version", "prefix_len", "prefix", "ranking_deadline_unix_ms")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    RANKING_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    request_id: str
    event_time_unix_ms: int
    user_id: int
    prefix_version: int
    prefix_len: int
    prefix: _ranker_pb2.UserPrefix
    ranking_deadline_unix_ms: int
    def __init__(self, schema_version: _Optional[int] = ..., request_id: _Optional[str] = ..., event_time_unix_ms: _Optional[int] = ..., user_id: _Optional[int] = ..., prefix_version: _Optional[int] = ..., prefix_len: _Optional[int] = ..., prefix: _Optional[_Union[_ranker_pb2.UserPrefix, _Mapping]] = ..., ranking_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class PreInferSignal(_message.Message):
    __slots__ = ("schema_version", "request_id", "signal_time_unix_ms", "prefix", "lease_deadline_unix_ms", "expected_instance", "prefetch_only", "user_id", "prefix_version", "prefix_ref", "ranking_deadline_unix_ms")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ONLY_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REF_FIELD_NUMBER: _ClassVar[int]
    RANKING_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    request_id: str
    signal_time_unix_ms: int
    prefix: _ranker_pb2.UserPrefix
    lease_deadline_unix_ms: int
    expected_instance: str
    prefetch_only: bool
    user_id: int
    prefix_version: int
    prefix_ref: _ranker_pb2.PrefixRef
    ranking_deadline_unix_ms: int
    def __init__(self, schema_version: _Optional[int] = ..., request_id: _Optional[str] = ..., signal_time_unix_ms: _Optional[int] = ..., prefix: _Optional[_Union[_ranker_pb2.UserPrefix, _Mapping]] = ..., lease_deadline_unix_ms: _Optional[int] = ..., expected_instance: _Optional[str] = ..., prefetch_only: _Optional[bool] = ..., user_id: _Optional[int] = ..., prefix_version: _Optional[int] = ..., prefix_ref: _Optional[_Union[_ranker_pb2.PrefixRef, _Mapping]] = ..., ranking_deadline_unix_ms: _Optional[int] = ...) -> None: ...
