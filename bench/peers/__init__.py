"""The peers kvpool is measured against, each started on 127.0.0.1 by the harness:
Redis (redis_peer) and Mooncake Store over TCP and in shared-memory client mode (mooncake_peer)."""
