"""Expert-cache research and runtime: policies and the expert cache, routing traces, the cache simulator (no GPU, no rich)."""
