from kvpool.wire.proto import store_pb2 as _store_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandoffState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_STATE_NONE: _ClassVar[HandoffState]
    HANDOFF_STATE_PEER: _ClassVar[HandoffState]
    HANDOFF_STATE_POOL: _ClassVar[HandoffState]
    HANDOFF_STATE_LOCAL: _ClassVar[HandoffState]
    HANDOFF_STATE_EXPIRED: _ClassVar[HandoffState]
    HANDOFF_STATE_GONE: _ClassVar[HandoffState]
HANDOFF_STATE_NONE: HandoffState
HANDOFF_STATE_PEER: HandoffState
HANDOFF_STATE_POOL: HandoffState
HANDOFF_STATE_LOCAL: HandoffState
HANDOFF_STATE_EXPIRED: HandoffState
HANDOFF_STATE_GONE: HandoffState

class HelloReply(_message.Message):
    __slots__ = ("arena_path", "arena_bytes", "tenant_id", "version", "ring_epoch", "pool_nodes", "handoff_address", "instance_id", "incarnation", "arena_generation")
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RING_EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOL_NODES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ARENA_GENERATION_FIELD_NUMBER: _ClassVar[int]
    arena_path: str
    arena_bytes: int
    tenant_id: str
    version: str
    ring_epoch: int
    pool_nodes: int
    handoff_address: str
    instance_id: str
    incarnation: int
    arena_generation: int
    def __init__(self, arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., tenant_id: _Optional[str] = ..., version: _Optional[str] = ..., ring_epoch: _Optional[int] = ..., pool_nodes: _Optional[int] = ..., handoff_address: _Optional[str] = ..., instance_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., arena_generation: _Optional[int] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("keys", "kind")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    kind: _store_pb2.Kind
    def __init__(self, keys: _Optional[bytes] = ..., kind: _Optional[_Union[_store_pb2.Kind, str]] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: bytes
    def __init__(self, present: _Optional[bytes] = ...) -> None: ...

class SidecarStats(_message.Message):
    __slots__ = ("counters", "local_capacity_bytes", "local_used_bytes", "local_objects", "ring_epoch", "pool_nodes_up", "pending_pool_bytes", "pool_read_bytes_per_s", "local_read_bytes_per_s", "lookup_seconds", "pool_read_samples", "local_read_samples", "lookup_samples")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    RING_EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOL_NODES_UP_FIELD_NUMBER: _ClassVar[int]
    PENDING_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOL_READ_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_READ_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    local_capacity_bytes: int
    local_used_bytes: int
    local_objects: int
    ring_epoch: int
    pool_nodes_up: int
    pending_pool_bytes: int
    pool_read_bytes_per_s: float
    local_read_bytes_per_s: float
    lookup_seconds: float
    pool_read_samples: int
    local_read_samples: int
    lookup_samples: int
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ..., local_capacity_bytes: _Optional[int] = ..., local_used_bytes: _Optional[int] = ..., local_objects: _Optional[int] = ..., ring_epoch: _Optional[int] = ..., pool_nodes_up: _Optional[int] = ..., pending_pool_bytes: _Optional[int] = ..., pool_read_bytes_per_s: _Optional[float] = ..., local_read_bytes_per_s: _Optional[float] = ..., lookup_seconds: _Optional[float] = ..., pool_read_samples: _Optional[int] = ..., local_read_samples: _Optional[int] = ..., lookup_samples: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("timeout_ms",)
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    def __init__(self, timeout_ms: _Optional[int] = ...) -> None: ...

class FlushReply(_message.Message):
    __slots__ = ("flushed_objects", "flushed_bytes", "dropped_objects")
    FLUSHED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    flushed_objects: int
    flushed_bytes: int
    dropped_objects: int
    def __init__(self, flushed_objects: _Optional[int] = ..., flushed_bytes: _Optional[int] = ..., dropped_objects: _Optional[int] = ...) -> None: ...

class ReadRangesRequest(_message.Message):
    __slots__ = ("keys", "counts", "ranges", "kind", "lease_ms", "verify_object", "release_lease_ids")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_OBJECT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    counts: _containers.RepeatedScalarFieldContainer[int]
    ranges: bytes
    kind: _store_pb2.Kind
    lease_ms: int
    verify_object: bool
    release_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[bytes] = ..., counts: _Optional[_Iterable[int]] = ..., ranges: _Optional[bytes] = ..., kind: _Optional[_Union[_store_pb2.Kind, str]] = ..., lease_ms: _Optional[int] = ..., verify_object: bool = ..., release_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadRangesReply(_message.Message):
    __slots__ = ("codes", "sizes", "offsets", "lease_id", "lease_expires_unix_ms", "local_hits", "pool_hits", "pool_bytes")
    CODES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HITS_FIELD_NUMBER: _ClassVar[int]
    POOL_HITS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    codes: _containers.RepeatedScalarFieldContainer[_store_pb2.Code]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lease_id: int
    lease_expires_unix_ms: int
    local_hits: int
    pool_hits: int
    pool_bytes: int
    def __init__(self, codes: _Optional[_Iterable[_Union[_store_pb2.Code, str]]] = ..., sizes: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., lease_id: _Optional[int] = ..., lease_expires_unix_ms: _Optional[int] = ..., local_hits: _Optional[int] = ..., pool_hits: _Optional[int] = ..., pool_bytes: _Optional[int] = ...) -> None: ...

class PublishPrefillRequest(_message.Message):
    __slots__ = ("keys", "prompt_tokens", "block_tokens", "state_position", "hold_ms", "record_ttl_ms", "timeout_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_POSITION_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    RECORD_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    prompt_tokens: int
    block_tokens: int
    state_position: int
    hold_ms: int
    record_ttl_ms: int
    timeout_ms: int
    def __init__(self, keys: _Optional[bytes] = ..., prompt_tokens: _Optional[int] = ..., block_tokens: _Optional[int] = ..., state_position: _Optional[int] = ..., hold_ms: _Optional[int] = ..., record_ttl_ms: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PublishPrefillReply(_message.Message):
    __slots__ = ("code", "message", "codes", "record", "blocks_written", "publish_us", "state_exported")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_US_FIELD_NUMBER: _ClassVar[int]
    STATE_EXPORTED_FIELD_NUMBER: _ClassVar[int]
    code: _store_pb2.Code
    message: str
    codes: _containers.RepeatedScalarFieldContainer[_store_pb2.Code]
    record: bytes
    blocks_written: int
    publish_us: int
    state_exported: bool
    def __init__(self, code: _Optional[_Union[_store_pb2.Code, str]] = ..., message: _Optional[str] = ..., codes: _Optional[_Iterable[_Union[_store_pb2.Code, str]]] = ..., record: _Optional[bytes] = ..., blocks_written: _Optional[int] = ..., publish_us: _Optional[int] = ..., state_exported: bool = ...) -> None: ...

class AcceptHandoffRequest(_message.Message):
    __slots__ = ("record", "lease_ms")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    record: bytes
    lease_ms: int
    def __init__(self, record: _Optional[bytes] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class AcceptHandoffReply(_message.Message):
    __slots__ = ("code", "message", "codes", "offsets", "sizes", "lease_id", "state", "state_offset", "state_size", "state_lease_id", "blocks_us", "state_us", "local_hits", "pool_hits", "state_detail")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_US_FIELD_NUMBER: _ClassVar[int]
    STATE_US_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HITS_FIELD_NUMBER: _ClassVar[int]
    POOL_HITS_FIELD_NUMBER: _ClassVar[int]
    STATE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    code: _store_pb2.Code
    message: str
    codes: _containers.RepeatedScalarFieldContainer[_store_pb2.Code]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    lease_id: int
    state: HandoffState
    state_offset: int
    state_size: int
    state_lease_id: int
    blocks_us: int
    state_us: int
    local_hits: int
    pool_hits: int
    state_detail: str
    def __init__(self, code: _Optional[_Union[_store_pb2.Code, str]] = ..., message: _Optional[str] = ..., codes: _Optional[_Iterable[_Union[_store_pb2.Code, str]]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., lease_id: _Optional[int] = ..., state: _Optional[_Union[HandoffState, str]] = ..., state_offset: _Optional[int] = ..., state_size: _Optional[int] = ..., state_lease_id: _Optional[int] = ..., blocks_us: _Optional[int] = ..., state_us: _Optional[int] = ..., local_hits: _Optional[int] = ..., pool_hits: _Optional[int] = ..., state_detail: _Optional[str] = ...) -> None: ...
