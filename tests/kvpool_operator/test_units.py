"""Quantities and durations: exact parsing, clear errors."""

import pytest

from kvpool_operator.units import format_bytes, format_quantity, format_time, parse_bytes, parse_duration, parse_time


@pytest.mark.parametrize(("text", "expected"), [
    ("4Gi", 4 << 30), ("512Mi", 512 << 20), ("1k", 1000), ("1.5Gi", 3 << 29), ("1048576", 1 << 20),
    (1024, 1024), ("1G", 10**9), ("0", 0),
])
def test_parse_bytes(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "4 GB", "Gi", "-1", "4Xi", True, None, [1]])
def test_parse_bytes_refuses(bad: object) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_bytes(bad, "quantity")


@pytest.mark.parametrize(("text", "seconds"), [
    ("72h", 259200.0), ("3d", 259200.0), ("1h30m", 5400.0), ("500ms", 0.5), ("90s", 90.0), (60, 60.0),
])
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "3 days", "h", "1h 2m", "x1h", -5])
def test_parse_duration_refuses(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_formatting() -> None:
    assert format_bytes(512) == "512B"
    assert format_bytes(3 << 29) == "1.5Gi"
    assert format_quantity(1 << 30) == "1Gi"
    assert format_quantity(1000) == "1000"
    assert format_quantity(1536 << 20) == "1536Mi"


def test_parse_time_reads_what_format_time_writes_and_zero_for_anything_else() -> None:
    assert parse_time(format_time(1_796_392_800_000)) == 1_796_392_800_000
    assert parse_time("2026-12-04T10:00:00.5+00:00") == 1_796_378_400_500
    for bad in (None, "", "yesterday", 17, "2026-13-01T00:00:00Z"):
        assert parse_time(bad) == 0
