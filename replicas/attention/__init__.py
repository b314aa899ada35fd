"""Attention backends behind one seam; one KV layout serves them all."""
