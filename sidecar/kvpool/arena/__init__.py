"""One preallocated memory region and its bookkeeping: extents, eviction choice, the DRAM arena
and the index of its objects (``index.ArenaIndex``, shared by the store node and the sidecar)."""
