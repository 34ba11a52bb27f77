from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[Code]
    NOT_FOUND: _ClassVar[Code]
    QUOTA_EXCEEDED: _ClassVar[Code]
    NO_SPACE: _ClassVar[Code]
    LEASE_EXPIRED: _ClassVar[Code]
    ALREADY_EXISTS: _ClassVar[Code]
    CHECKSUM: _ClassVar[Code]
    INVALID: _ClassVar[Code]
    WRONG_OWNER: _ClassVar[Code]
    IN_FLIGHT: _ClassVar[Code]
    DRAINING: _ClassVar[Code]
    TOO_LARGE: _ClassVar[Code]
    WRONG_TENANT: _ClassVar[Code]
    HANDOFF_INVALID: _ClassVar[Code]
    HANDOFF_EXPIRED: _ClassVar[Code]
    UNSUPPORTED: _ClassVar[Code]
    UNAVAILABLE: _ClassVar[Code]

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK: _ClassVar[Kind]
    STATE: _ClassVar[Kind]
OK: Code
NOT_FOUND: Code
QUOTA_EXCEEDED: Code
NO_SPACE: Code
LEASE_EXPIRED: Code
ALREADY_EXISTS: Code
CHECKSUM: Code
INVALID: Code
WRONG_OWNER: Code
IN_FLIGHT: Code
DRAINING: Code
TOO_LARGE: Code
WRONG_TENANT: Code
HANDOFF_INVALID: Code
HANDOFF_EXPIRED: Code
UNSUPPORTED: Code
UNAVAILABLE: Code
BLOCK: Kind
STATE: Kind

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids", "incarnation")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    incarnation: int
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("keys", "kind")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    kind: Kind
    def __init__(self, keys: _Optional[bytes] = ..., kind: _Optional[_Union[Kind, str]] = ...) -> None: ...

class CodesReply(_message.Message):
    __slots__ = ("codes",)
    CODES_FIELD_NUMBER: _ClassVar[int]
    codes: _containers.RepeatedScalarFieldContainer[Code]
    def __init__(self, codes: _Optional[_Iterable[_Union[Code, str]]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "objects")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    objects: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., objects: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant_id", "used_bytes", "quota_bytes", "objects", "counters", "share_bytes")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SHARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    used_bytes: int
    quota_bytes: int
    objects: int
    counters: _containers.ScalarMap[str, int]
    share_bytes: int
    def __init__(self, tenant_id: _Optional[str] = ..., used_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., objects: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., share_bytes: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("node_id", "epoch", "tiers", "tenants", "counters", "hit_blocks", "lookup_blocks", "draining", "incarnation", "foreign_bytes")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FOREIGN_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    counters: _containers.ScalarMap[str, int]
    hit_blocks: int
    lookup_blocks: int
    draining: bool
    incarnation: int
    foreign_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., hit_blocks: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., draining: bool = ..., incarnation: _Optional[int] = ..., foreign_bytes: _Optional[int] = ...) -> None: ...

class RingMember(_message.Message):
    __slots__ = ("id", "address", "state", "transfer_address", "rdma_device")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RDMA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    state: str
    transfer_address: str
    rdma_device: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., transfer_address: _Optional[str] = ..., rdma_device: _Optional[str] = ...) -> None: ...

class Ring(_message.Message):
    __slots__ = ("epoch", "members", "replicas")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    members: _containers.RepeatedCompositeFieldContainer[RingMember]
    replicas: int
    def __init__(self, epoch: _Optional[int] = ..., members: _Optional[_Iterable[_Union[RingMember, _Mapping]]] = ..., replicas: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("ring", "deadline_unix_ms", "max_bytes_per_second")
    RING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ring: Ring
    deadline_unix_ms: int
    max_bytes_per_second: int
    def __init__(self, ring: _Optional[_Union[Ring, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., max_bytes_per_second: _Optional[int] = ...) -> None: ...

class DrainStatus(_message.Message):
    __slots__ = ("state", "moved_objects", "moved_bytes", "dropped_objects", "dropped_bytes", "remaining_objects", "deadline_unix_ms", "epoch")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MOVED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    MOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMAINING_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    state: str
    moved_objects: int
    moved_bytes: int
    dropped_objects: int
    dropped_bytes: int
    remaining_objects: int
    deadline_unix_ms: int
    epoch: int
    def __init__(self, state: _Optional[str] = ..., moved_objects: _Optional[int] = ..., moved_bytes: _Optional[int] = ..., dropped_objects: _Optional[int] = ..., dropped_bytes: _Optional[int] = ..., remaining_objects: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class TenantConfig(_message.Message):
    __slots__ = ("tenant_id", "token", "salt", "quota_bytes", "ttl_seconds", "evict_own_on_quota")
    class TtlSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVICT_OWN_ON_QUOTA_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    token: str
    salt: bytes
    quota_bytes: int
    ttl_seconds: _containers.ScalarMap[str, int]
    evict_own_on_quota: bool
    def __init__(self, tenant_id: _Optional[str] = ..., token: _Optional[str] = ..., salt: _Optional[bytes] = ..., quota_bytes: _Optional[int] = ..., ttl_seconds: _Optional[_Mapping[str, int]] = ..., evict_own_on_quota: bool = ...) -> None: ...

class SetTenantsRequest(_message.Message):
    __slots__ = ("tenants", "replace")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantConfig]
    replace: bool
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantConfig, _Mapping]]] = ..., replace: bool = ...) -> None: ...

class PolicyRequest(_message.Message):
    __slots__ = ("ttl_seconds", "high_watermark", "low_watermark")
    class TtlSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: _containers.ScalarMap[str, int]
    high_watermark: float
    low_watermark: float
    def __init__(self, ttl_seconds: _Optional[_Mapping[str, int]] = ..., high_watermark: _Optional[float] = ..., low_watermark: _Optional[float] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ok", "node_id", "epoch", "transfer_address", "incarnation", "rdma_device", "data_session_plaintext")
    OK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RDMA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    DATA_SESSION_PLAINTEXT_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    node_id: str
    epoch: int
    transfer_address: str
    incarnation: int
    rdma_device: str
    data_session_plaintext: bool
    def __init__(self, ok: bool = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., transfer_address: _Optional[str] = ..., incarnation: _Optional[int] = ..., rdma_device: _Optional[str] = ..., data_session_plaintext: bool = ...) -> None: ...

class DataTicketReply(_message.Message):
    __slots__ = ("ticket", "expires_unix_ms")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    expires_unix_ms: int
    def __init__(self, ticket: _Optional[bytes] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class ConnectRdmaRequest(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: bytes
    def __init__(self, endpoint: _Optional[bytes] = ...) -> None: ...

class ConnectRdmaReply(_message.Message):
    __slots__ = ("endpoint", "arena_key", "incarnation")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ARENA_KEY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    endpoint: bytes
    arena_key: bytes
    incarnation: int
    def __init__(self, endpoint: _Optional[bytes] = ..., arena_key: _Optional[bytes] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HoldExtentsRequest(_message.Message):
    __slots__ = ("keys", "kind", "hold_ms", "drop_lease_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    DROP_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    kind: Kind
    hold_ms: int
    drop_lease_id: int
    def __init__(self, keys: _Optional[bytes] = ..., kind: _Optional[_Union[Kind, str]] = ..., hold_ms: _Optional[int] = ..., drop_lease_id: _Optional[int] = ...) -> None: ...

class HoldExtentsReply(_message.Message):
    __slots__ = ("codes", "offsets", "sizes", "checksums", "hold_id", "epoch", "incarnation")
    CODES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    HOLD_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    codes: _containers.RepeatedScalarFieldContainer[Code]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    hold_id: int
    epoch: int
    incarnation: int
    def __init__(self, codes: _Optional[_Iterable[_Union[Code, str]]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., hold_id: _Optional[int] = ..., epoch: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class ReleaseExtentsRequest(_message.Message):
    __slots__ = ("hold_ids",)
    HOLD_IDS_FIELD_NUMBER: _ClassVar[int]
    hold_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hold_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveRdmaRequest(_message.Message):
    __slots__ = ("keys", "sizes", "traffic_class", "kind", "timeout_ms", "epoch")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    traffic_class: str
    kind: Kind
    timeout_ms: int
    epoch: int
    def __init__(self, keys: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., traffic_class: _Optional[str] = ..., kind: _Optional[_Union[Kind, str]] = ..., timeout_ms: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReserveRdmaReply(_message.Message):
    __slots__ = ("codes", "offsets", "reservation_id", "epoch", "incarnation")
    CODES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    codes: _containers.RepeatedScalarFieldContainer[Code]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    reservation_id: int
    epoch: int
    incarnation: int
    def __init__(self, codes: _Optional[_Iterable[_Union[Code, str]]] = ..., offsets: _Optional[_Iterable[int]] = ..., reservation_id: _Optional[int] = ..., epoch: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class CommitRdmaRequest(_message.Message):
    __slots__ = ("reservation_id", "checksums", "revoke")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    revoke: bool
    def __init__(self, reservation_id: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., revoke: bool = ...) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ("ring", "added", "deadline_unix_ms", "max_bytes_per_second", "fraction", "removed")
    RING_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ring: Ring
    added: _containers.RepeatedScalarFieldContainer[str]
    deadline_unix_ms: int
    max_bytes_per_second: int
    fraction: float
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ring: _Optional[_Union[Ring, _Mapping]] = ..., added: _Optional[_Iterable[str]] = ..., deadline_unix_ms: _Optional[int] = ..., max_bytes_per_second: _Optional[int] = ..., fraction: _Optional[float] = ..., removed: _Optional[_Iterable[str]] = ...) -> None: ...

class WarmStatus(_message.Message):
    __slots__ = ("state", "planned_objects", "planned_bytes", "moved_objects", "moved_bytes", "skipped_objects", "skipped_bytes", "failed_objects", "remaining_objects", "deadline_unix_ms", "epoch")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PLANNED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MOVED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    MOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    state: str
    planned_objects: int
    planned_bytes: int
    moved_objects: int
    moved_bytes: int
    skipped_objects: int
    skipped_bytes: int
    failed_objects: int
    remaining_objects: int
    deadline_unix_ms: int
    epoch: int
    def __init__(self, state: _Optional[str] = ..., planned_objects: _Optional[int] = ..., planned_bytes: _Optional[int] = ..., moved_objects: _Optional[int] = ..., moved_bytes: _Optional[int] = ..., skipped_objects: _Optional[int] = ..., skipped_bytes: _Optional[int] = ..., failed_objects: _Optional[int] = ..., remaining_objects: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...
