"""Can Habana's media pipeline run here, and so which loader a run uses.

``--mediapipe_dataloader`` asks for the media pipeline; ``choose_loader`` decides which loader runs and
says why, loudly: upstream silently fell back to the CPU loader, so a "mediapipe" benchmark might not have
used it. The loader names are the ones the saved metrics record (``loader``). Nothing here imports Habana
modules at import time: the check runs, and is tested, on any machine.
"""

from __future__ import annotations

from typing import Optional

from bridgetower_bench.mediapipe.graph import media_api


MEDIAPIPE_LOADER = "mediapipe"
TORCH_LOADER = "torch"
SUPPORTED_DEVICES = ("GAUDI2", "GAUDI3")


def mediapipe_unavailable_reason() -> Optional[str]:
    """Why the media pipeline cannot run here, or None when it can.

    It can only on a Gaudi2 or Gaudi3 device with both ``habana_frameworks.mediapipe`` and
    ``habana_frameworks.torch`` importable (first-generation Gaudi has no HPU JPEG decoder).
    """
    reason = _import_failure("habana_frameworks.mediapipe", "the habana-media-loader package")
    if reason:
        return reason
    reason = _import_failure("habana_frameworks.torch.hpu", "Habana's PyTorch build")
    if reason:
        return reason
    try:
        import habana_frameworks.torch.hpu as hpu

        if not hpu.is_available():
            return "no HPU device is visible"
        device_name = str(hpu.get_device_name())
    except Exception as error:  # the Habana runtime raises assorted types when no device is usable
        return f"cannot query the HPU device: {type(error).__name__}: {error}"
    if not device_name.upper().startswith(SUPPORTED_DEVICES):
        return f"no Gaudi2/Gaudi3 device (found: {device_name})"
    try:
        media_api()
    except Exception as error:
        return f"the media pipeline's modules cannot be loaded: {type(error).__name__}: {error}"
    return None


def _import_failure(module: str, distribution: str) -> Optional[str]:
    """None if ``module`` imports, else a one-line reason (native-library errors included)."""
    try:
        __import__(module)
    except ModuleNotFoundError as error:
        if error.name and module.startswith(error.name):
            return f"{module} is not installed (it comes with {distribution})"
        return f"{module} cannot be imported: {error}"
    except Exception as error:  # e.g. OSError from a missing native library
        return f"{module} cannot be imported: {type(error).__name__}: {error}"
    return None


def choose_loader(requested: bool) -> tuple[str, Optional[str]]:
    """Pick the loader for a run: returns (loader string for the saved metrics, reason or None).

    ``("mediapipe", None)`` when requested and available; ``("torch (media pipeline unavailable:
    <reason>)", reason)`` when requested but unavailable (the script logs one loud warning with the
    reason, and the metrics record that the PyTorch loader ran); ``("torch", None)`` otherwise.
    """
    if not requested:
        return TORCH_LOADER, None
    reason = mediapipe_unavailable_reason()
    if reason is None:
        return MEDIAPIPE_LOADER, None
    return f"{TORCH_LOADER} (media pipeline unavailable: {reason})", reason
