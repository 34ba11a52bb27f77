"""What every handler shares: settings, the Kubernetes API, store-node channels, and
per-object serialisation (a timer, a watch event and a spec change may ask for the same
reconcile at once; one runs, the others make it run once more)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .kube import Kube
from .nodes import Nodes
from .settings import Settings


@dataclass
class Coalescer:
    """Run ``fn`` for a key at most once at a time; requests during a run cause one more run."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _running: set[str] = field(default_factory=set)
    _dirty: set[str] = field(default_factory=set)

    def run(self, key: str, fn: Callable[[], None]) -> bool:
        """True when this call ran ``fn`` (False: it was folded into a running one)."""
        with self._lock:
            if key in self._running:
                self._dirty.add(key)
                return False
            self._running.add(key)
        try:
            while True:
                fn()
                with self._lock:
                    if key not in self._dirty:
                        break
                    self._dirty.discard(key)
        finally:
            with self._lock:
                self._running.discard(key)
                self._dirty.discard(key)
        return True


@dataclass
class Runtime:
    settings: Settings
    kube: Kube
    nodes: Nodes
    pools: Coalescer = field(default_factory=Coalescer)
    tenants: Coalescer = field(default_factory=Coalescer)
