"""Sealed memfd regions (kvpool.transfer.memfd): what a sidecar may map of a client's memory."""

from __future__ import annotations

import os
import tempfile

import pytest

from kvpool.transfer import memfd


def test_a_region_is_shared_by_its_descriptor_and_cannot_shrink() -> None:
    region = memfd.create(1 << 20)
    try:
        assert region.fd is not None and region.size == 1 << 20
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, 4096)  # the seal: a mapping of it can never lose its pages
        other = memfd.adopt(os.dup(region.fd), 1 << 30)
        try:
            other.view[100:105] = b"hello"  # what the sidecar writes, the client reads
            assert bytes(region.view[100:105]) == b"hello" and other.fd is None
        finally:
            other.close()
    finally:
        region.close()
    assert region.fd is None


def test_adopt_refuses_what_could_fault_or_is_too_big() -> None:
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 4096)
    with pytest.raises(ValueError, match="not sealed against shrinking"):
        memfd.adopt(unsealed, 1 << 30)
    with pytest.raises(OSError):
        os.fstat(unsealed)  # adopt closed it, refused or not
    with tempfile.TemporaryFile(dir=os.getcwd()) as f:
        f.truncate(4096)
        fd = os.dup(f.fileno())
        with pytest.raises(ValueError, match="memory file|sealed"):
            memfd.adopt(fd, 1 << 30)  # a plain file (not a memfd) cannot carry the seal
    region = memfd.create(8192)
    try:
        assert region.fd is not None
        with pytest.raises(ValueError, match="over the limit of 4096"):
            memfd.adopt(os.dup(region.fd), 4096)
    finally:
        region.close()
    with pytest.raises(ValueError, match="positive"):
        memfd.create(0)
