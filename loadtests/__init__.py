"""Load tests and the serving benchmark: HTTP clients of any OpenAI-compatible server.

Nothing in the project imports this package; it imports neither `replicas` nor
`cluster` (compare.py only launches `python -m cluster.serve_local` as a process).
"""
