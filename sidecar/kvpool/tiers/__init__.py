"""The Tier interface (``base``) and the tiers below DRAM (SSD slot file, shared filesystem),
encryption at rest (``atrest`` keys and format, ``sealed`` the tier wrapper) and tier moves."""
