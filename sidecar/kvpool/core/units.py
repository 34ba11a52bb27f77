"""Byte sizes as people write them on command lines ('512MiB', '4G'), parsed in one place (pure)."""

from __future__ import annotations

import argparse

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'512MiB', '4G', '1048576' → bytes; a clear error for anything else."""
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (use e.g. 512MiB, 4GiB, 1048576)")
    try:
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("byte sizes must be non-negative")
    return int(value)
