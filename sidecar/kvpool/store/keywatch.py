"""Re-reads a store node's master-key files when they change (a rotated Secret).

Kubernetes updates a mounted Secret in place (an atomic symlink swap, within about a minute of
the edit), so a rotation reaches running nodes without a restart: each check compares the
files' identity (inode, size, mtime) with the last one loaded and, on a change, hands the new
keys to the node.  A file that is now unreadable or invalid keeps the old keys (and says so):
sealing under a half-written key would lose every object sealed with it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from kvpool.store.node import StoreNode
from kvpool.tiers.atrest import MasterKeyError, load_master_key, load_previous_keys
from kvpool.wire.counters import StoreCounter

log = logging.getLogger("kvpool.store.keys")

Signature = tuple[tuple[int, int, int] | None, ...]


def file_signature(paths: Sequence[str]) -> Signature:
    """What identifies the current content of each file (None: absent)."""
    out: list[tuple[int, int, int] | None] = []
    for p in paths:
        try:
            st = os.stat(p)  # follows the Secret volume's ..data symlink
        except FileNotFoundError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class MasterKeyWatcher:
    def __init__(self, node: StoreNode, key_file: str, previous_file: str, interval: float) -> None:
        self.node, self.interval = node, interval
        self.paths = [key_file] + ([previous_file] if previous_file else [])
        self._seen = file_signature(self.paths)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="master-keys", daemon=True)

    def start(self) -> MasterKeyWatcher:
        if self.interval > 0:
            self._thread.start()
        return self

    def check(self) -> bool:
        """Load the keys if the files changed; True when the node now has new keys."""
        sig = file_signature(self.paths)
        if sig == self._seen:
            return False
        try:
            current = load_master_key(self.paths[0])
            previous = load_previous_keys(self.paths[1]) if len(self.paths) > 1 else []
            self.node.set_master_keys(current, previous)
        except (MasterKeyError, ValueError) as exc:
            self.node.count(StoreCounter.MASTER_KEY_RELOAD_ERRORS)
            log.error("master key files changed but cannot be used, keeping the keys loaded before: %s", exc)
            return False
        finally:
            self._seen = sig  # an invalid version is reported once, not on every check
        log.info("master keys reloaded: %d held", 1 + len(previous))
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # never let housekeeping kill the node
                log.exception("master key check failed")

    def stop(self) -> None:
        self._stop.set()
