"""The Gaudi configuration a run trains with (`--gaudi_config_name`, e.g. `Habana/clip`), as optimum-habana takes it.

optimum-habana 1.21's `GaudiConfig` accepts any key and drops those it does not know without a word, and
`use_torch_autocast` defaults to false: a file with other keys than expected trains in fp32 and says nothing. So
the Gaudi script reads the file as a dict first (`GaudiConfig.get_config_dict`, then `from_dict`, what
`from_pretrained` does), the trainer logs at its start and records in `train_results.json` what it really runs
(`effective`, the `gaudi_*` keys), and the self-check's Hub row reads the published file the same way
(`ignored_keys`). The class is passed in: nothing here imports optimum-habana.
"""

from __future__ import annotations

from typing import Optional


AUTOCAST_KEY = "use_torch_autocast"
# The keys `effective` records (train_results.json; `tools/compare.py` says when runs differ in them).
RECORD_KEYS = (
    "gaudi_autocast",
    "gaudi_autocast_bf16_ops",
    "gaudi_autocast_fp32_ops",
    "gaudi_fused_adam",
    "gaudi_fused_clip_norm",
    "gaudi_config_ignored_keys",
)
NOT_DECLARED = "not declared (the bridge's defaults)"


def known_keys(config_class) -> frozenset:
    """The keys `config_class` reads from a file: those it writes itself (its settings and the versions saved
    beside them)."""
    return frozenset(config_class().to_dict())


def ignored_keys(config_file: dict, config_class) -> list[str]:
    """The keys of `config_file` (a Gaudi configuration as a dict) that `config_class` drops."""
    known = known_keys(config_class)
    return sorted(key for key in config_file if key not in known)


def effective(gaudi_config, config_file: dict, autocast: bool, on_hpu: bool) -> dict:
    """What the run trains with: bf16 autocast on or off (`autocast`: the trainer's own decision), the op lists
    it declares (used only when both are given: `GaudiConfig.declare_autocast_bf16_fp32_ops`), fused AdamW and
    gradient clipping (used on an HPU only), and the file's keys GaudiConfig ignored."""
    bf16_ops, fp32_ops = gaudi_config.autocast_bf16_ops, gaudi_config.autocast_fp32_ops
    declared = autocast and bf16_ops is not None and fp32_ops is not None

    def ops(names: Optional[list]) -> Optional[str]:
        if not autocast:
            return None
        return ", ".join(names) if declared and names is not None else NOT_DECLARED

    return {
        "gaudi_autocast": bool(autocast),
        "gaudi_autocast_bf16_ops": ops(bf16_ops),
        "gaudi_autocast_fp32_ops": ops(fp32_ops),
        "gaudi_fused_adam": bool(gaudi_config.use_fused_adam and on_hpu),
        "gaudi_fused_clip_norm": bool(gaudi_config.use_fused_clip_norm and on_hpu),
        "gaudi_config_ignored_keys": ", ".join(ignored_keys(config_file, type(gaudi_config))) or "none",
    }


def describe(record: dict) -> str:
    """`effective`'s record as the run's log line says it."""
    autocast = "on" if record["gaudi_autocast"] else "off (fp32)"
    ops = (
        f" (bf16 ops: {record['gaudi_autocast_bf16_ops']}; fp32 ops: {record['gaudi_autocast_fp32_ops']})"
        if record["gaudi_autocast"]
        else ""
    )
    on = {True: "on", False: "off"}
    return (
        f"Gaudi configuration in effect: bf16 autocast {autocast}{ops}, fused AdamW {on[record['gaudi_fused_adam']]}, "
        f"fused gradient clipping {on[record['gaudi_fused_clip_norm']]}; keys GaudiConfig ignored: "
        f"{record['gaudi_config_ignored_keys']}"
    )
