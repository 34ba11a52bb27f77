"""The store node: a shard of the keyspace with a DRAM arena and tiers below it (DESIGN §4)."""
