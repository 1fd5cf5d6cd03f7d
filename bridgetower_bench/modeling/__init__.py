"""Faster model code, same weights: fused attention, layers compiled in place."""
