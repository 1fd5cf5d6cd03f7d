"""Everything about --output_dir: the run directory, the recipe, checkpoints' manifests, atomic files, disk space."""
