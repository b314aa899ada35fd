"""The parts of the local launcher, `python -m cluster.serve_local` (README.md here)."""
