"""The engine replicas and the way to them: `EngineReplica`, the wire types, the
per-step channel's two ends, each request's relay, routing (README.md here)."""
