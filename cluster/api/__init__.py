"""The OpenAI-compatible HTTP surface each `Ingress` replica serves (README.md here)."""
