"""Pure building blocks of the data plane: keys, ring, planning, ranges, error codes, checksums (no I/O)."""
