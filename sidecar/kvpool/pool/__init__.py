"""Talking to the pool's store nodes: one client per node, routing by the ring, batched fan-out."""
