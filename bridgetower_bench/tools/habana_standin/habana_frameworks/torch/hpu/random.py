"""Habana stand-in for habana_frameworks.torch.hpu.random: see habana_standin/README.md."""


def manual_seed_all(seed):
    """optimum.habana.utils.set_seed seeds the HPU generators too; a CPU run has none."""
