"""The router match API's pure parts: key spaces from JSON, the leading run, request errors."""

from __future__ import annotations

import pytest

from kvpool.apps.router_api import key_space_from, leading_run
from kvpool.core import errors
from kvpool.core.keys import KeySpace


def test_key_space_from_json_matches_the_engines() -> None:
    ks = key_space_from({"model": "m", "revision": "r", "lora": "a", "kv_dtype": "fp8", "layout": "tp2r0",
                         "extra": {"img": "h"}, "block_tokens": 16})
    assert ks.seed == KeySpace("m", "r", "a", "fp8", "tp2r0", {"img": "h"}, 16).seed
    assert key_space_from({"model": "m"}).block_tokens == 128


@pytest.mark.parametrize("doc,match", [
    ({}, "model is required"), ({"model": 3}, "model is required"), ({"model": "m", "block_tokens": 0}, "block_tokens"),
    ({"model": "m", "block_tokens": True}, "block_tokens"), ({"model": "m", "extra": {"a": 1}}, "extra"),
    ({"model": "m", "seed": "x"}, "unknown fields"),
])
def test_bad_key_spaces(doc: dict[str, object], match: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=match):
        key_space_from(doc)


def test_leading_run() -> None:
    assert leading_run([]) == 0
    assert leading_run([True, True, False, True]) == 2
    assert leading_run([False, True]) == 0
    assert leading_run([True] * 5) == 5
