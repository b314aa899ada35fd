"""Llama-family models (Llama 2/3, Mistral, Qwen2, Qwen3) from local HF directories."""
