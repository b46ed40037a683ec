"""Per-unit costs and memory: model architectures, the analytic cost model, measured profiles, sharding, recomputation,
CPU offload and the runtime's fixed overheads."""
