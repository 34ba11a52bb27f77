from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KeySpace(_message.Message):
    __slots__ = ("model", "revision", "lora", "kv_dtype", "layout", "extra", "block_tokens")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    lora: str
    kv_dtype: str
    layout: str
    extra: _containers.ScalarMap[str, str]
    block_tokens: int
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., lora: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., layout: _Optional[str] = ..., extra: _Optional[_Mapping[str, str]] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class PoolMatchRequest(_message.Message):
    __slots__ = ("key_space", "tokens", "keys")
    KEY_SPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    key_space: KeySpace
    tokens: _containers.RepeatedScalarFieldContainer[int]
    keys: bytes
    def __init__(self, key_space: _Optional[_Union[KeySpace, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., keys: _Optional[bytes] = ...) -> None: ...

class PoolMatchReply(_message.Message):
    __slots__ = ("hit_blocks", "hit_tokens", "blocks", "block_tokens", "epoch")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    hit_tokens: int
    blocks: int
    block_tokens: int
    epoch: int
    def __init__(self, hit_blocks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., block_tokens: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...
