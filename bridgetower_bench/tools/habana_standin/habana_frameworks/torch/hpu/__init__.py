"""Habana stand-in for habana_frameworks.torch.hpu: see habana_standin/README.md."""


def memory_stats(device=None):
    """GaudiTrainer.log reads these three keys; there is no HPU memory on a CPU run."""
    return {"InUse": 0, "MaxInUse": 0, "Limit": 0}


def is_available():
    """No HPU on a machine running the shim: tools that look for one (gaudi_check) say so and stop."""
    return False
