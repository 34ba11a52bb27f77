"""Storage tiers below DRAM (SSD slot file, shared filesystem), encryption at rest and tier moves."""
