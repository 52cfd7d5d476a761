"""Layers: parameters plus one call into the ops, PyTorch-style."""
