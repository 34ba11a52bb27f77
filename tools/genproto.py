"""Regenerate the gRPC/protobuf modules from sidecar/kvpool/wire/proto/*.proto.

`python tools/genproto.py` writes them next to the .proto files; `--check` regenerates into a
temporary directory and fails if the committed files differ (run by the tests).
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "sidecar"
PROTO_DIR = SRC / "kvpool" / "wire" / "proto"


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    for proto in protos:
        rel = proto.relative_to(SRC)
        rc = protoc.main(["protoc", f"-I{SRC}", f"--python_out={out}", f"--pyi_out={out}",
                          f"--grpc_python_out={out}", str(rel)])
        if rc != 0:
            raise SystemExit(f"protoc failed on {rel} (exit {rc})")
    return sorted((out / "kvpool" / "wire" / "proto").glob("*_pb2*.py*"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if not args.check:
        import os
        os.chdir(SRC)
        generate(SRC)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(pathlib.Path(tmp))
        stale = [f.name for f in files if not (PROTO_DIR / f.name).exists()
                 or not filecmp.cmp(f, PROTO_DIR / f.name, shallow=False)]
        if stale:
            print("generated code is stale, run python tools/genproto.py:", ", ".join(stale))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
