"""`python -m kvpool` is the `kvpool` command."""

import ctypes
import os
import signal
import sys

from kvpool.apps.cli import main

_PR_SET_PDEATHSIG = 1

# Started by a LocalCluster (or the benchmarks): die with the parent so nothing is orphaned.
# Armed here rather than in a preexec_fn (see kvpool.apps.cluster); if the parent already died between
# fork and this line, exit at once.
_parent = os.environ.pop("KVPOOL_DIE_WITH_PARENT", "")
if _parent:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if str(os.getppid()) != _parent:
        sys.exit(1)

sys.exit(main())
