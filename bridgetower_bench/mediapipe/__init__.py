"""Habana's media pipeline: availability, the image files it reads, its inputs, graph, data loader and trainer."""
