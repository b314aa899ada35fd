"""From a step's logits to its tokens: sampling and its constraints (README.md here)."""
