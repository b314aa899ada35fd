"""The paged KV cache: its blocks, their hashes and how many there are (README.md here)."""
