"""kvpool's benchmark harness: side-by-side throughput and latency against Redis, Mooncake Store
and the machine's ceilings. Entry point: `python bench/run.py --suite store|sidecar`."""
