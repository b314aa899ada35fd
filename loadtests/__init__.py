"""Load tests and benchmarks; nothing in replicas, deltas or cluster imports this package.

Six entry points at the top (bench, bench_engine, soak, fake_server, gpu_check and the
locust file); their parts in rooms by job: serving/ (the HTTP clients: no `replicas`,
no Ray), engine/ (the offline engine's modes), gpu/ (the GPU check's parts).
README.md: the tools; each room's README.md: its files.
"""
