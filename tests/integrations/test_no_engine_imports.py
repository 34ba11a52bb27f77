"""`import kvpool` (and the integrations' shared helpers) never pulls in torch or an engine."""

import subprocess
import sys

ENGINE_MODULES = ("torch", "vllm", "sglang", "lmcache")


def test_import_kvpool_imports_no_engine() -> None:
    code = ("import sys, kvpool, kvpool.integrations, kvpool.integrations.common, kvpool.integrations.staging, "
            "kvpool.integrations.vllm_pd, "
            "kvpool.client.client, "
            "kvpool.apps.cluster; "
            f"print(sorted(m for m in {ENGINE_MODULES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_framing_round_trip_and_damage() -> None:
    from kvpool.integrations.common import HEADER_BYTES, check_object, fingerprint, write_header

    layout = fingerprint(["layer0", (2, 16), "float16"])
    assert layout == fingerprint(["layer0", (2, 16), "float16"]) != fingerprint(["layer0", (2, 16), "bfloat16"])
    buf = bytearray(HEADER_BYTES + 100)
    buf[HEADER_BYTES:] = bytes(range(100))
    write_header(memoryview(buf), layout)
    assert check_object(memoryview(buf), layout) is None
    assert check_object(memoryview(buf), layout, HEADER_BYTES + 100) is None
    assert check_object(memoryview(buf), layout, HEADER_BYTES + 64) == "object of 132 bytes, this layout's are 96"
    assert "layout" in (check_object(memoryview(buf), layout + 1) or "")
    assert check_object(memoryview(buf)[:HEADER_BYTES + 99], layout) == "payload of 99 bytes, header says 100"
    buf[-1] ^= 1
    assert check_object(memoryview(buf), layout) == "checksum mismatch"
    assert "shorter than its header" in (check_object(memoryview(b"KVPB"), layout) or "")
    assert "not a kvpool engine block" in (check_object(memoryview(bytes(64)), layout) or "")
