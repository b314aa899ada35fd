"""The offline engine's modes (`python -m loadtests.bench_engine`): in process, no HTTP."""
