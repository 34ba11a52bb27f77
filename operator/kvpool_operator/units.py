"""Parsing of Kubernetes quantities and kvpool durations, and their human-readable display.

Pure and strict: anything that is not a valid value raises :class:`ValueError` naming it, so a
bad spec fails fast with a clear message instead of becoming a zero.
"""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal, InvalidOperation
from typing import Any

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY = re.compile(r"^([+]?[0-9]+(?:\.[0-9]*)?|[+]?\.[0-9]+)([a-zA-Z]{0,2})$")
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_bytes(value: object, what: str = "quantity") -> int:
    """A Kubernetes quantity (``4Gi``, ``512M``, ``1048576`` or an int) as whole bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: not a byte quantity: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: must not be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0:
            raise ValueError(f"{what}: must not be negative, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{what}: not a byte quantity: {value!r}")
    m = _QUANTITY.match(value.strip())
    if not m:
        raise ValueError(f"{what}: not a byte quantity: {value!r} (use e.g. 4Gi or 4294967296)")
    num, suffix = m.groups()
    mult = _BINARY.get(suffix) or _DECIMAL.get(suffix)
    if mult is None:
        raise ValueError(f"{what}: unknown quantity suffix {suffix!r} in {value!r}")
    try:
        return int(Decimal(num) * mult)
    except InvalidOperation:
        raise ValueError(f"{what}: not a byte quantity: {value!r}") from None


def parse_duration(value: object, what: str = "duration") -> float:
    """``72h``, ``3d``, ``1h30m``, ``500ms`` or a number of seconds, as seconds."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: not a duration: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"{what}: must not be negative, got {value}")
        return float(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what}: not a duration: {value!r}")
    pos, total = 0, 0.0
    for m in _DURATION.finditer(value):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(value):
        raise ValueError(f"{what}: not a duration: {value!r} (use e.g. 72h, 7d, 90s)")
    return total


def format_bytes(n: int) -> str:
    """Binary units with one decimal: ``1.5Gi``; plain bytes below 1 KiB."""
    if n < 1024:
        return f"{n}B"
    for unit in ("Ki", "Mi", "Gi", "Ti", "Pi"):
        n_f = n / _BINARY[unit]
        if n_f < 1024 or unit == "Pi":
            return f"{n_f:.1f}{unit}"
    raise AssertionError("unreachable")


def format_quantity(n: int) -> str:
    """Bytes as an exact Kubernetes quantity (``1Gi`` when it divides, else the integer)."""
    for unit in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        if n and n % _BINARY[unit] == 0:
            return f"{n // _BINARY[unit]}{unit}"
    return str(n)


def memory_volume_limit(n: int) -> str:
    """The sizeLimit of a memory-backed volume that must hold ``n`` bytes: rounded up to whole
    MiB (readable in the pod spec; the rest is slack)."""
    mib = _BINARY["Mi"]
    return format_quantity(-(-n // mib) * mib)


def format_percent(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def format_time(unix_ms: int) -> str:
    """An instant as Kubernetes writes one in status (RFC 3339, UTC, whole seconds)."""
    return dt.datetime.fromtimestamp(unix_ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(stamp: Any) -> int:
    """An RFC 3339 time of the API (``2026-12-04T10:00:00Z``) in Unix ms; 0 if absent or unreadable."""
    if not isinstance(stamp, str) or not stamp:
        return 0
    try:
        return int(dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        return 0
