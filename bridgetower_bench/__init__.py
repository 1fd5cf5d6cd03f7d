"""Shared machinery for the BridgeTower contrastive fine-tuning benchmark scripts."""
