"""The published command's Hub names, resolved before a long run: rows of the self-checks' table.

Where the Hub answers, a few small requests (the repositories' file lists, two small JSON files; never weights
or data) say whether the published run would start:

- the data set (`published.DATASET` at `published.DATASET_REVISION`): no loading script (`datasets` 4 and later
  run none), and config `published.DATASET_CONFIG` present (in the card's `configs`, or as a folder of files);
- the model (`published.MODEL`): weights in a file kind transformers loads, and a `config.json` whose
  `model_type` maps to the configuration class the scripts' model takes;
- on Gaudi, the Gaudi configuration (`published.GAUDI_CONFIG`): every key known to the installed `GaudiConfig`
  (it drops the others without a word: a warning naming them) and `use_torch_autocast` true, since the published
  Gaudi command has no `--bf16`: without it the run trains in fp32 (the row fails).

Offline (`HF_HUB_OFFLINE`) or without an answer within `TIMEOUT` seconds every row says "not checked (offline)"
and counts as skipped. A missing repository, revision or file fails its row.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Optional

from bridgetower_bench import gaudi_configuration, published
from bridgetower_bench.tools.self_check import FAILED, OK, SKIPPED, WARNING, Row


TIMEOUT = 10.0  # seconds per request: a Hub that has not answered by then counts as unreachable
DATASET_ROW, MODEL_ROW, GAUDI_CONFIG_ROW = "Hub: data set", "Hub: model", "Hub: Gaudi config"
NOT_CHECKED = "not checked (offline)"


class Unreachable(Exception):
    """The Hub did not answer (offline mode, no network, a timeout): the rows left are not checked."""


def rows(gaudi_config: bool = False, api: Any = None, download: Optional[Callable[..., str]] = None) -> list[Row]:
    """The Hub rows: data set and model, and with `gaudi_config` the Gaudi configuration. `api` (an `HfApi`) and
    `download` (`hf_hub_download`) are replaceable for tests."""
    from huggingface_hub import HfApi, constants, hf_hub_download

    api, download = api or HfApi(), download or hf_hub_download
    checks = [(DATASET_ROW, lambda: dataset_row(api)), (MODEL_ROW, lambda: model_row(api, download))]
    if gaudi_config:
        checks.append((GAUDI_CONFIG_ROW, lambda: gaudi_config_row(download)))
    if constants.HF_HUB_OFFLINE:
        return [Row(name, SKIPPED, f"{NOT_CHECKED}: HF_HUB_OFFLINE is set") for name, _ in checks]
    found = []
    for index, (name, check) in enumerate(checks):
        try:
            found.append(check())
        except Unreachable as reason:
            return found + [Row(later, SKIPPED, f"{NOT_CHECKED}: {reason}") for later, _ in checks[index:]]
    return found


def ask(call: Callable[[], Any], what: str) -> Any:
    """`call`'s answer; the Hub's refusal (no such repository, revision or file; gated) as `LookupError`, no answer
    at all as `Unreachable`."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        return call()
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:  # (no connection, and nothing cached)
        raise Unreachable(f"{what}: {first_line(error)}") from None
    except HfHubHTTPError as error:
        raise LookupError(f"{what}: {type(error).__name__}: {first_line(error)}") from None
    except Exception as error:  # a failed or timed-out connection, as the installed HTTP client names it
        raise Unreachable(f"{what}: no answer within {TIMEOUT:.0f} s ({type(error).__name__})") from None


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def file_names(info) -> list[str]:
    return [sibling.rfilename for sibling in info.siblings or []]


def dataset_row(api) -> Row:
    name, revision, config = published.DATASET, published.DATASET_REVISION, published.DATASET_CONFIG
    where = f"{name}@{revision[:7]}"
    try:
        info = ask(lambda: api.dataset_info(name, revision=revision, timeout=TIMEOUT), where)
    except LookupError as error:
        return Row(DATASET_ROW, FAILED, str(error))
    files = file_names(info)
    script = f"{name.split('/')[-1]}.py"
    if script in files:
        return Row(
            DATASET_ROW,
            FAILED,
            f"{where} holds the loading script {script}: datasets 4 and later run none, so the published run "
            "stops while loading the data; pin a revision with data files",
        )
    card = info.card_data.get("configs") if info.card_data is not None else None
    configs = [entry.get("config_name") for entry in card or [] if isinstance(entry, dict)]
    data_files = [file for file in files if file.startswith(f"{config}/")]
    if config not in configs and not data_files:
        return Row(
            DATASET_ROW,
            FAILED,
            f"{where} has no config {config} (configs in its card: {', '.join(map(str, configs)) or 'none'})",
        )
    return Row(
        DATASET_ROW,
        OK,
        f"{where}: config {config}, {len(data_files)} data files under {config}/, no loading script",
    )


def model_row(api, download) -> Row:
    from transformers import CONFIG_MAPPING, BridgeTowerConfig
    from transformers.utils import (
        CONFIG_NAME,
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    name, revision = published.MODEL, published.MODEL_REVISION
    where = f"{name}@{revision}"
    try:
        files = file_names(ask(lambda: api.model_info(name, revision=revision, timeout=TIMEOUT), where))
        weights = [
            f for f in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME) if f in files
        ]
        if not weights:
            return Row(
                MODEL_ROW,
                FAILED,
                f"{where} holds no weights transformers loads ({SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or their index)",
            )
        config = json_file(download, name, CONFIG_NAME, revision)
    except LookupError as error:
        return Row(MODEL_ROW, FAILED, str(error))
    model_type = config.get("model_type")
    expected = BridgeTowerConfig  # (BridgeTowerForContrastiveLearning's config_class)
    found = CONFIG_MAPPING[model_type] if isinstance(model_type, str) and model_type in CONFIG_MAPPING else None
    if found is not expected:
        return Row(
            MODEL_ROW,
            FAILED,
            f"{where}: its {CONFIG_NAME} says model_type {model_type!r} "
            f"({found.__name__ if found else 'no configuration class'}), not {expected.__name__}'s",
        )
    return Row(MODEL_ROW, OK, f"{where}: {', '.join(weights)}; {CONFIG_NAME}: {expected.__name__}")


def gaudi_config_row(download) -> Row:
    name, revision = published.GAUDI_CONFIG, published.MODEL_REVISION  # (the scripts read it at --model_revision)
    try:
        from optimum.habana import GaudiConfig
        from optimum.habana.version import __version__ as optimum_habana
    except Exception as error:
        return Row(GAUDI_CONFIG_ROW, FAILED, f"optimum-habana cannot be imported: {type(error).__name__}: {error}")
    try:
        config = json_file(download, name, GaudiConfig.CONFIG_NAME, revision)
    except LookupError as error:
        return Row(GAUDI_CONFIG_ROW, FAILED, str(error))
    return judge_gaudi_config(f"{name} {GaudiConfig.CONFIG_NAME}", config, GaudiConfig, optimum_habana)


def judge_gaudi_config(where: str, config: dict, config_class, optimum_habana: str) -> Row:
    """Failed when the file leaves bf16 autocast off; a warning naming the keys the installed class ignores."""
    autocast = config.get(gaudi_configuration.AUTOCAST_KEY)
    settings = ", ".join(f"{key} {json.dumps(value)}" for key, value in config.items() if key.startswith("use_"))
    if autocast is not True:
        said = "absent (GaudiConfig's default: false)" if autocast is None else json.dumps(autocast)
        return Row(
            GAUDI_CONFIG_ROW,
            FAILED,
            f"{where}: {gaudi_configuration.AUTOCAST_KEY} {said}: the published Gaudi command (no --bf16) "
            "would train without bf16 autocast, in fp32",
        )
    ignored = gaudi_configuration.ignored_keys(config, config_class)
    if ignored:
        return Row(
            GAUDI_CONFIG_ROW,
            WARNING,
            f"{where}: keys optimum-habana {optimum_habana}'s GaudiConfig ignores without a word: {', '.join(ignored)}",
        )
    return Row(GAUDI_CONFIG_ROW, OK, f"{where}: {settings}; every key known to optimum-habana {optimum_habana}")


def json_file(download, repository: str, filename: str, revision: str) -> dict:
    """A small JSON file of a model repository, downloaded (into the Hub's cache) and read; `LookupError` when the
    Hub has none or it holds no JSON object."""
    where = f"{repository}@{revision} {filename}"
    path = ask(lambda: download(repository, filename, revision=revision, etag_timeout=TIMEOUT), where)
    try:
        with open(path, encoding="utf-8") as file:
            found = json.load(file)
    except (OSError, ValueError) as error:
        raise LookupError(f"{where}: unreadable ({type(error).__name__}: {first_line(error)})") from None
    if not isinstance(found, dict):
        raise LookupError(f"{where}: not a JSON object")
    return found
