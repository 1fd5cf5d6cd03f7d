"""Can Habana's media pipeline run here, and so which loader a run uses (docs/ARCHITECTURE.md, "mediapipe/")."""

from __future__ import annotations

from typing import Optional

from bridgetower_bench.mediapipe.graph import media_api


MEDIAPIPE_LOADER = "mediapipe"
TORCH_LOADER = "torch"
SUPPORTED_DEVICES = ("GAUDI2", "GAUDI3")  # first-generation Gaudi has no HPU JPEG decoder


def mediapipe_unavailable_reason() -> Optional[str]:
    """Why the media pipeline cannot run here (the first piece missing), or None when it can."""
    for module, distribution in (
        ("habana_frameworks.mediapipe", "the habana-media-loader package"),
        ("habana_frameworks.torch.hpu", "Habana's PyTorch build"),
    ):
        try:
            __import__(module)
        except ModuleNotFoundError as error:
            if error.name and module.startswith(error.name):
                return f"{module} is not installed (it comes with {distribution})"
            return f"{module} cannot be imported: {error}"
        except Exception as error:  # e.g. OSError from a missing native library
            return f"{module} cannot be imported: {type(error).__name__}: {error}"
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


def choose_loader(requested: bool) -> tuple[str, Optional[str]]:
    """(the loader name the metrics record, why the requested media pipeline cannot run or None)."""
    if not requested:
        return TORCH_LOADER, None
    reason = mediapipe_unavailable_reason()
    if reason is None:
        return MEDIAPIPE_LOADER, None
    return f"{TORCH_LOADER} (media pipeline unavailable: {reason})", reason
