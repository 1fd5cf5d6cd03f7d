"""What a run measures and records: throughput and data wait, energy, the environment it ran in."""
