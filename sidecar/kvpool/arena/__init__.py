"""One preallocated memory region and its bookkeeping: extents, eviction choice, the DRAM arena."""
