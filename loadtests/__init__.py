"""Load tests and benchmarks; nothing in replicas, deltas or cluster imports this package.

The HTTP clients (bench, locustfile, soak) import neither `replicas` nor Ray; the
offline tools (engine_runner and what runs it, gpu_check) import the engine; the
launcher's flags (fake_server), the /proc process table (process_cpu) and a local
Ray app (serving_matrix's routing preset) come from `cluster`. README.md: the tools.
"""
