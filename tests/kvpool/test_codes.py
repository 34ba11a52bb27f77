"""The result codes and object kinds of ``kvpool.core.errors`` are exactly the wire's (store.proto)."""

from kvpool.core.errors import Code, Kind, code_name, error_for_code
from kvpool.wire.proto import store_pb2 as pb


def test_code_enum_is_the_protos() -> None:
    assert {c.name: c.value for c in Code} == dict(pb.Code.items())


def test_kind_enum_is_the_protos() -> None:
    assert {k.name: k.value for k in Kind} == dict(pb.Kind.items())


def test_unknown_code_is_named_not_raised() -> None:
    assert code_name(Code.CHECKSUM) == "CHECKSUM"
    assert code_name(200) == "code 200"
    assert type(error_for_code(200)).__name__ == "KvpoolError"
