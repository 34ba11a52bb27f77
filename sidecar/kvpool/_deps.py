"""The client's own dependencies for an engine image that lacks them (issue 7 §4, injection).

The webhook's ``kvpool.io/engine`` injection copies the client package into a shared volume
(``python3 -m kvpool._deps install DIR`` in an init container of the kvpool image).  The client needs
grpcio (with its pure typing-extensions), protobuf and xxhash besides numpy (and torch for the
integrations), which every engine image has.  ``install`` copies those next to the package, into
``DIR/kvpool-deps``, with the interpreter ABI they were built for; at ``import kvpool``,
:func:`provide` appends that directory to ``sys.path`` (after site-packages: the engine's own
versions always win) when one of them is missing and the ABI is the engine's.  Only these are
copied, not numpy nor torch: the engines ship those, and theirs must be the ones loaded.  grpcio
and xxhash are compiled extensions for one CPython version and platform: on an engine image of
another Python the copies cannot load, and the import fails with the reason and the fix (install
them in the image, or ship kvpool in it with ``kvpool.io/engine-client: image``) instead of an
ImportError from deep inside grpc.

An engine image that has its own, older protobuf or grpcio keeps it (one version per process, and
the engine's code depends on it): kvpool's generated code then fails at import with protobuf's (or
grpc's) own version error, which names both versions.

A regular install has no ``kvpool-deps`` beside the package: :func:`provide` is one ``isdir``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Sequence

DEPS_DIR = "kvpool-deps"
ABI_FILE = "ABI.json"
# module (what the client imports) -> the distribution an engine image would install it from
MODULES = {"grpc": "grpcio", "google.protobuf": "protobuf", "xxhash": "xxhash",
           "typing_extensions": "typing-extensions"}  # grpcio's own pure dependency
# directories a module needs copied besides its own (protobuf's compiled upb runtime)
EXTRA_DIRS = {"google.protobuf": ("google._upb",)}


def abi() -> dict[str, str]:
    """What compiled extensions are built for: the interpreter's cache tag and platform."""
    return {"cache_tag": str(sys.implementation.cache_tag), "platform": sysconfig.get_platform()}


def abi_mismatch(built: dict[str, str], here: dict[str, str]) -> str | None:
    """Why copies built for ``built`` cannot load under ``here`` (None when they can)."""
    for k in ("cache_tag", "platform"):
        if built.get(k) != here.get(k):
            return f"{k} {built.get(k)!r} (kvpool image) != {here.get(k)!r} (engine)"
    return None


def missing(modules: Sequence[str] = tuple(MODULES)) -> list[str]:
    """The modules the client needs that this interpreter cannot import."""
    out = []
    for m in modules:
        try:
            if importlib.util.find_spec(m) is None:
                out.append(m)
        except ModuleNotFoundError:  # the parent package (google) is absent too
            out.append(m)
    return out


def _copy_module(module: str, deps: str) -> None:
    """Copy a package directory, or a single-file module, under ``deps`` at its import path."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ModuleNotFoundError(f"kvpool._deps install: {module} is not installed here")
    dst = os.path.join(deps, *module.split("."))
    if spec.submodule_search_locations:
        shutil.copytree(list(spec.submodule_search_locations)[0], dst, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    elif spec.origin and spec.origin.endswith(".py"):
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        shutil.copy2(spec.origin, dst + ".py")
    else:
        raise ModuleNotFoundError(f"kvpool._deps install: cannot copy {module} ({spec.origin})")


def install(target: str) -> list[str]:
    """Copy the client package and its grpcio/protobuf/xxhash/typing-extensions into ``target`` (the shared volume);
    returns the module names copied."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    shutil.copytree(pkg, os.path.join(target, "kvpool"), dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    deps = os.path.join(target, DEPS_DIR)
    copied = []
    for m in MODULES:
        for name in (m, *EXTRA_DIRS.get(m, ())):
            if importlib.util.find_spec(name) is None:
                continue  # an optional companion (a protobuf without upb)
            _copy_module(name, deps)
        copied.append(m)
    with open(os.path.join(deps, ABI_FILE), "w") as f:
        json.dump(abi(), f)
    return copied


def provide() -> None:
    """Make the copied dependencies importable where the engine lacks them (see the module doc)."""
    deps = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), DEPS_DIR)
    if not os.path.isdir(deps) or deps in sys.path:
        return
    need = missing()
    if not need:
        return
    try:
        with open(os.path.join(deps, ABI_FILE)) as f:
            built = json.load(f)
    except (OSError, ValueError) as exc:
        raise ImportError(f"kvpool: {DEPS_DIR} has no readable {ABI_FILE} ({exc}); reinstall the client copy") from exc
    why = abi_mismatch(built, abi())
    if why is not None:
        pip = " ".join(MODULES[m] for m in need)
        raise ImportError(f"kvpool client needs {', '.join(need)}, which this engine image lacks; the copies "
                          f"from the kvpool image cannot load here ({why}): install them in the engine image "
                          f"(pip install {pip}) or ship kvpool in it (annotation kvpool.io/engine-client: image)")
    sys.path.append(deps)  # after site-packages: only what the engine lacks comes from here
    importlib.invalidate_caches()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "install":
        print("usage: python -m kvpool._deps install DIR", file=sys.stderr)
        return 2
    copied = install(args[1])
    print(f"kvpool client and {', '.join(copied)} copied to {args[1]} ({abi()['cache_tag']}, {abi()['platform']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
