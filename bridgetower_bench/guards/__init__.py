"""Runs refused or stopped cleanly: devices and flags checked before loading, memory, divergence, signals."""
