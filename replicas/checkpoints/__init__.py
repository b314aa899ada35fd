"""Which checkpoint a model name means, on disk, and what start-up reads from it
(README.md here)."""
