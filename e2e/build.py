"""Cached, idempotent build of the control-plane binaries the e2e harness runs.

The machine has no container engine and reaches only package registries, so every binary is
built from its Go module through the module proxy:

* kube-apiserver, kube-controller-manager and kubectl from ``k8s.io/kubernetes``. Its go.mod
  replaces the staging modules (``k8s.io/api`` ...) with local paths, which ``go install
  pkg@version`` refuses, so we build from a small wrapper module that requires
  ``k8s.io/kubernetes`` and replaces each staging module with its published ``v0.<minor>.<patch>``
  release. The list is *derived* from the downloaded go.mod, never hard-coded.
* etcd from a wrapper module around ``go.etcd.io/etcd/server/v3`` (whose own go.mod has replace
  lines for its sibling modules, which we translate the same way).
* helm from ``helm.sh/helm/v3/cmd/helm``.

Everything (module cache, build cache, binaries) lives under ``$KVPOOL_CACHE`` (default
``~/.cache/kvpool``), which survives on the machine between CI runs. A step whose output binary
exists is skipped, so a warm run takes well under a second.

Usage: ``python -m e2e.build`` (prints the binary paths), or ``ensure_binaries()`` from Python.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime as _dt
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

K8S_VERSION = os.environ.get("KVPOOL_K8S_VERSION", "v1.37.2")
ETCD_VERSION = os.environ.get("KVPOOL_ETCD_VERSION", "v3.6.16")
HELM_VERSION = os.environ.get("KVPOOL_HELM_VERSION", "v3.22.0")
COREDNS_VERSION = os.environ.get("KVPOOL_COREDNS_VERSION", "v1.15.0")

GO = os.environ.get("KVPOOL_GO") or shutil.which("go") or "/usr/local/go/bin/go"


def cache_dir() -> Path:
    """Root of everything this module writes; kept between runs on purpose."""
    return Path(os.environ.get("KVPOOL_CACHE") or Path.home() / ".cache" / "kvpool")


@dataclasses.dataclass(frozen=True)
class Binaries:
    """Absolute paths of the built executables."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kubectl: Path
    etcd: Path
    helm: Path
    kubelet: Path
    kube_scheduler: Path
    kube_proxy: Path
    coredns: Path


def _go_env() -> dict[str, str]:
    cache = cache_dir()
    env = dict(os.environ)
    env.update(
        GOMODCACHE=str(cache / "gomod"),
        GOCACHE=str(cache / "gocache"),
        # A newer toolchain cannot be downloaded here (only module proxies are reachable), and a
        # silent toolchain switch would make the cache key unpredictable.
        GOTOOLCHAIN="local",
        # Static binaries: no libc coupling, and the k8s release binaries are built this way.
        CGO_ENABLED="0",
        # -modcacherw: the module cache stays deletable with a plain `rm -rf`.
        GOFLAGS="-buildvcs=false -mod=mod -modcacherw",
        GOWORK="off",
    )
    return env


def _run(args: list[str], cwd: Path, log: Path | None = None) -> str:
    """Run a go command; on failure show its output (the go tool is terse but precise)."""
    proc = subprocess.run(args, cwd=cwd, env=_go_env(), text=True, capture_output=True)
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"$ {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed in {cwd}:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def _download_gomod(module: str, version: str, workdir: Path) -> str:
    """Fetch only the module's go.mod (cheap) and return its text."""
    out = _run([GO, "mod", "download", "-json", f"{module}@{version}"], cwd=workdir)
    match = re.search(r'"GoMod":\s*"([^"]+)"', out)
    if not match:
        raise RuntimeError(f"no GoMod in go mod download output for {module}@{version}: {out}")
    return Path(match.group(1)).read_text()


_REQUIRE_LINE = re.compile(r"^\s*(?:require\s+)?([\w./\-]+)\s+(v[\w.\-+]+)")


def required_modules(gomod: str) -> set[str]:
    """Module paths named in the require directives of a go.mod text."""
    mods: set[str] = set()
    in_block = False
    for raw in gomod.splitlines():
        line = raw.split("//", 1)[0].strip()
        if line.startswith("require ("):
            in_block = True
            continue
        if in_block and line == ")":
            in_block = False
            continue
        if in_block or line.startswith("require "):
            m = _REQUIRE_LINE.match(line)
            if m:
                mods.add(m.group(1))
    return mods


def local_replacements(gomod: str) -> dict[str, str]:
    """Map module path -> local directory for every ``X => ./dir`` replace in a go.mod text."""
    found: dict[str, str] = {}
    for raw in gomod.splitlines():
        line = raw.split("//", 1)[0].strip()
        line = line.removeprefix("replace ").strip()
        m = re.match(r"^([\w./\-]+)(?:\s+v\S+)?\s*=>\s*(\.{1,2}/\S*)$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def k8s_staging_replaces(gomod: str, k8s_version: str) -> list[str]:
    """Replace lines pinning each staging module the kubernetes go.mod requires.

    Staging modules are published as ``v0.<minor>.<patch>`` for release ``v1.<minor>.<patch>``.
    Only modules that are also *required* get a line: a few staging directories (the samples)
    are never released at every version, and replacing a module outside the graph is pointless.
    """
    major, minor, patch = k8s_version.lstrip("v").split(".")[:3]
    staged = {
        mod
        for mod, path in local_replacements(gomod).items()
        if path.startswith("./staging/src/k8s.io/")
    }
    if not staged:
        raise RuntimeError("kubernetes go.mod has no staging replacements; layout changed?")
    needed = sorted(staged & required_modules(gomod))
    return [f"replace {mod} => {mod} v0.{minor}.{patch}" for mod in needed]


def _version_ldflags(packages: list[str], version: str, commit: str = "") -> str:
    """-X flags that make ``--version`` print the release instead of ``v0.0.0-master``."""
    major, minor = version.lstrip("v").split(".")[:2]
    build_date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    values = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": build_date,
    }
    if commit:
        values["gitCommit"] = commit
    flags = [f"-X {pkg}.{k}={v}" for pkg in packages for k, v in values.items()]
    # -s -w: no symbol table/DWARF; these binaries are never debugged here and it halves disk.
    return " ".join(["-s", "-w", *flags])


def _write_module(workdir: Path, module: str, go_version: str, body: str) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "go.mod").write_text(f"module {module}\n\ngo {go_version}\n\n{body}\n")


def _go_directive(gomod: str) -> str:
    m = re.search(r"^go\s+(\S+)", gomod, re.M)
    return m.group(1) if m else "1.24"


def _fetch_module(src: str, local: str, module: str, version: str) -> tuple[Path, str]:
    """A build module ``local`` in the cache's ``src/<src>`` that downloads ``module`` at
    ``version``; returns its directory and ``module``'s go.mod."""
    workdir = cache_dir() / "src" / src
    workdir.mkdir(parents=True, exist_ok=True)
    _write_module(workdir, local, "1.24", "")
    return workdir, _download_gomod(module, version, workdir)


def _atomic_build(workdir: Path, pkgs: list[str], ldflags: str, outdir: Path, log: Path,
                  rename: dict[str, str] | None = None, keep: dict[str, Path] | None = None,
                  ) -> None:
    """One ``go build`` for all packages into a temp dir, then rename: a half-built set never
    looks finished to the next run. ``keep`` names binaries already built to carry over
    (hard-linked: a running copy is never rewritten)."""
    tmp = outdir.with_name(outdir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, path in (keep or {}).items():
        os.link(path, tmp / name)
    _run([GO, "mod", "tidy"], cwd=workdir, log=log)
    # -p 2: the machines have two cores; more parallel compiles only add memory pressure.
    _run([GO, "build", "-p", "2", "-trimpath", "-ldflags", ldflags, "-o", str(tmp) + "/", *pkgs],
         cwd=workdir, log=log)
    for old, new in (rename or {}).items():
        if (tmp / old).exists():
            (tmp / old).rename(tmp / new)
    shutil.rmtree(outdir, ignore_errors=True)
    tmp.rename(outdir)


def _tool_block(pkgs: list[str]) -> str:
    # `tool` directives (Go 1.24+) let `go mod tidy` see the main packages we build.
    return "tool (\n" + "".join(f"\t{p}\n" for p in pkgs) + ")\n"


K8S_COMMANDS = ["kube-apiserver", "kube-controller-manager", "kubectl",
                "kubelet", "kube-scheduler", "kube-proxy"]


def build_kubernetes(version: str = K8S_VERSION) -> Path:
    """Control plane, kubectl and the node's binaries (kubelet, kube-proxy); returns their
    directory. One ``go build`` shares the many packages they have in common; a cache that
    holds only some of them (made before the node binaries were added) builds the rest."""
    cache = cache_dir()
    outdir = cache / "bin" / f"kubernetes-{version}"
    missing = [n for n in K8S_COMMANDS if not (outdir / n).exists()]
    if not missing:
        return outdir
    workdir, gomod = _fetch_module(f"kubernetes-{version}", "kvpool.local/k8sbuild",
                                   "k8s.io/kubernetes", version)
    pkgs = [f"k8s.io/kubernetes/cmd/{n}" for n in K8S_COMMANDS]
    body = (
        f"require k8s.io/kubernetes {version}\n\n"
        + "\n".join(k8s_staging_replaces(gomod, version))
        + "\n\n"
        + _tool_block(pkgs)
    )
    _write_module(workdir, "kvpool.local/k8sbuild", _go_directive(gomod), body)
    ldflags = _version_ldflags(
        ["k8s.io/component-base/version", "k8s.io/client-go/pkg/version"], version
    )
    kept = {n: outdir / n for n in K8S_COMMANDS if n not in missing}
    _atomic_build(workdir, [f"k8s.io/kubernetes/cmd/{n}" for n in missing], ldflags, outdir,
                  cache / "build.log", keep=kept)
    return outdir


def build_etcd(version: str = ETCD_VERSION) -> Path:
    """etcd server binary; returns its directory."""
    cache = cache_dir()
    outdir = cache / "bin" / f"etcd-{version}"
    if (outdir / "etcd").exists():
        return outdir
    workdir, gomod = _fetch_module(f"etcd-{version}", "kvpool.local/etcdbuild",
                                   "go.etcd.io/etcd/server/v3", version)
    # server/v3's go.mod replaces its siblings (api/v3, client/v3, pkg/v3 ...) with ../ paths;
    # they are all released under the same tag, so pin each to the same version.
    replaces = [
        f"replace {mod} => {mod} {version}"
        for mod in sorted(local_replacements(gomod))
        if mod.startswith("go.etcd.io/etcd/")
    ]
    pkg = "go.etcd.io/etcd/server/v3"
    body = f"require {pkg} {version}\n\n" + "\n".join(replaces) + "\n\n" + _tool_block([pkg])
    _write_module(workdir, "kvpool.local/etcdbuild", _go_directive(gomod), body)
    _atomic_build(workdir, [pkg], "-s -w", outdir, cache / "build.log",
                  rename={"server": "etcd", "v3": "etcd"})
    return outdir


def build_helm(version: str = HELM_VERSION) -> Path:
    """helm v3 CLI; returns its directory."""
    cache = cache_dir()
    outdir = cache / "bin" / f"helm-{version}"
    if (outdir / "helm").exists():
        return outdir
    workdir, gomod = _fetch_module(f"helm-{version}", "kvpool.local/helmbuild",
                                   "helm.sh/helm/v3", version)
    pkg = "helm.sh/helm/v3/cmd/helm"
    body = f"require helm.sh/helm/v3 {version}\n\n" + _tool_block([pkg])
    _write_module(workdir, "kvpool.local/helmbuild", _go_directive(gomod), body)
    _, minor = version.lstrip("v").split(".")[:2]
    # helm reads its version from internal/version; k8s.io/client-go's is stamped too so
    # `helm version` and the user agent it sends agree with the release.
    ldflags = " ".join(
        [
            "-s -w",
            f"-X helm.sh/helm/v3/internal/version.version={version}",
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
        ]
    )
    _atomic_build(workdir, [pkg], ldflags, outdir, cache / "build.log")
    return outdir


# The plugins a cluster DNS for the harness needs, in CoreDNS's execution order (its
# plugin.cfg order). Building only these instead of the release's ~60
# plugins skips the cloud SDKs they pull in (Azure, AWS, GCP): a fraction of the download and
# of the compile.
COREDNS_PLUGINS = ["ready", "health", "errors", "log", "loadbalance", "cache", "kubernetes"]

_COREDNS_MAIN = """// Generated by e2e/build.py: CoreDNS with only the plugins the harness's cluster DNS uses.
package main

import (
\t"github.com/coredns/coredns/core/dnsserver"
\t"github.com/coredns/coredns/coremain"
%(imports)s
)

func init() {
\tdnsserver.Directives = []string{%(directives)s}
}

func main() { coremain.Run() }
"""


def build_coredns(version: str = COREDNS_VERSION) -> Path:
    """CoreDNS (cluster DNS of the real-node tier) with a trimmed plugin set; returns its
    directory."""
    cache = cache_dir()
    outdir = cache / "bin" / f"coredns-{version}"
    if (outdir / "coredns").exists():
        return outdir
    workdir, gomod = _fetch_module(f"coredns-{version}", "kvpool.local/corednsbuild",
                                   "github.com/coredns/coredns", version)
    (workdir / "main.go").write_text(_COREDNS_MAIN % {
        "imports": "\n".join(f'\t_ "github.com/coredns/coredns/plugin/{p}"'
                             for p in COREDNS_PLUGINS),
        "directives": ", ".join(f'"{p}"' for p in COREDNS_PLUGINS),
    })
    body = f"require github.com/coredns/coredns {version}\n"
    _write_module(workdir, "kvpool.local/corednsbuild", _go_directive(gomod), body)
    ldflags = f"-s -w -X github.com/coredns/coredns/coremain.GitCommit={version}"
    _atomic_build(workdir, ["."], ldflags, outdir, cache / "build.log",
                  rename={"corednsbuild": "coredns"})
    return outdir


def ensure_binaries(log: bool = False) -> Binaries:
    """Build whatever is missing (each step skipped when its output exists) and return paths.

    Missing components build concurrently: the kubernetes build keeps both cores busy only
    while compiling, and its long single-threaded link steps leave room for etcd and helm.
    """
    steps: dict[str, Callable[[], Path]] = dict(_STEPS)
    with build_lock():
        return _ensure(steps, log)


_STEPS: dict[str, Callable[[], Path]] = {
    "kubernetes": build_kubernetes, "etcd": build_etcd, "helm": build_helm,
    "coredns": build_coredns,
}


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    """One build at a time per cache: two test runs (CI beside a working tree) starting cold would
    each wipe the other's half-built output directory; the second waits, then finds it built."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "build.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ensure(steps: dict[str, Callable[[], Path]], log: bool) -> Binaries:
    def timed(name: str) -> Path:
        start = time.monotonic()
        out = steps[name]()
        if log:
            print(f"[e2e.build] {name}: {time.monotonic() - start:.1f}s -> {out}",
                  file=sys.stderr, flush=True)
        return out

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(steps)) as pool:
        futures = {name: pool.submit(timed, name) for name in steps}
        dirs = {name: fut.result() for name, fut in futures.items()}
    k8s = dirs["kubernetes"]
    return Binaries(
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kubectl=k8s / "kubectl",
        etcd=dirs["etcd"] / "etcd",
        helm=dirs["helm"] / "helm",
        kubelet=k8s / "kubelet",
        kube_scheduler=k8s / "kube-scheduler",
        kube_proxy=k8s / "kube-proxy",
        coredns=dirs["coredns"] / "coredns",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(_STEPS),
                        help="build one component only")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.only:
        with build_lock():
            print(_STEPS[args.only]())
    else:
        bins = ensure_binaries(log=True)
        for field in dataclasses.fields(bins):
            print(f"{field.name}={getattr(bins, field.name)}")
    print(f"[e2e.build] total {time.monotonic() - start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
