"""The master-key Secret check (pure): what makes a pool Degraded instead of crash-looping nodes."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from kvpool_operator.encryption import master_key_problem


def _secret(**entries: bytes | str) -> dict[str, Any]:
    return {"data": {k: v if isinstance(v, str) else base64.b64encode(v).decode() for k, v in entries.items()}}


GOOD = b"k" * 43


@pytest.mark.parametrize("secret", [_secret(key=GOOD), _secret(key=GOOD + b"\n"), _secret(key=bytes(range(32))),
                                    _secret(key=GOOD, previous=b"p" * 40 + b"\n" + b"q" * 32 + b"\n"),
                                    _secret(key=GOOD, previous=b""), _secret(key=GOOD, other=b"ignored")])
def test_usable_secrets(secret: dict[str, Any]) -> None:
    assert master_key_problem(secret, "s", "ns") is None


@pytest.mark.parametrize("secret, reason, words", [
    (None, "MasterKeySecretMissing", "does not exist"),
    ({}, "MasterKeyInvalid", "no 'key'"),
    (_secret(previous=GOOD), "MasterKeyInvalid", "no 'key'"),
    (_secret(key=b"short"), "MasterKeyInvalid", "at least 32 bytes"),
    (_secret(key="%%% not base64"), "MasterKeyInvalid", "no 'key'"),
    (_secret(key=GOOD, previous=b"short\n"), "MasterKeyInvalid", "previous master key 1"),
])
def test_unusable_secrets_say_why(secret: dict[str, Any] | None, reason: str, words: str) -> None:
    got = master_key_problem(secret, "s", "ns")
    assert got is not None and got[0] == reason and words in got[1] and "ns/s" in got[1], got
