"""The self-checks' Hub rows (tools/hub_check.py) against a stand-in for the Hub client: no network.

The stand-in answers as the Hub's API does (huggingface_hub's own `DatasetInfo` / `ModelInfo` built from the
JSON the API returns), with the repositories' file lists below, and keeps every request it was asked.
"""

import json
from types import SimpleNamespace

import pytest
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.hf_api import DatasetInfo, ModelInfo

from bridgetower_bench import published
from bridgetower_bench.tools import hub_check
from helpers import BOTH_ROUTES, optimum_habana


# The data set's trees as the Hub's stored pages show them (checked 2026-12-06): the revision upstream's CI pins
# holds a loading script and no data; the parquet revision holds config `matching` as parquet files and names
# it in its card (the shard names follow the Hub's parquet uploads; their count is not recorded).
SCRIPT_REVISION = [".gitattributes", "README.md", "dataset_infos.json", "newyorker_caption_contest.py"]
PARQUET_REVISION = [
    ".gitattributes",
    "README.md",
    "matching/test-00000-of-00001.parquet",
    "matching/train-00000-of-00001.parquet",
    "matching/validation-00000-of-00001.parquet",
]
MATCHING_CARD = {
    "configs": [{"config_name": "matching", "data_files": [{"split": "train", "path": "matching/train-*"}]}]
}
# The model's files (weights, configuration, processor and tokenizer) and its config.json's model type.
MODEL_FILES = [".gitattributes", "README.md", "config.json", "preprocessor_config.json", "pytorch_model.bin"]
MODEL_CONFIG = {"architectures": ["BridgeTowerForContrastiveLearning"], "model_type": "bridgetower"}
# Habana/clip's gaudi_config.json: the three settings (#54's issue text; the fixture's copy).
HABANA_CLIP = {"use_fused_adam": True, "use_fused_clip_norm": True, "use_torch_autocast": True}


def refusal(kind, message):
    """The Hub's refusal as huggingface_hub raises it (a stand-in response: no HTTP here)."""
    response = SimpleNamespace(headers={}, status_code=404, url="https://huggingface.co", request=None, text="")
    return kind(message, response=response)


class StandInHub:
    """`HfApi` and `hf_hub_download` in one: answers from `repos` ({name: files, or an exception to raise}) and
    `json_files` ({(name, filename): content}); `asked` holds every request."""

    def __init__(self, tmp_path, repos=None, json_files=None, card=MATCHING_CARD):
        self.tmp_path, self.card, self.asked = tmp_path, card, []
        self.repos = {published.DATASET: PARQUET_REVISION, published.MODEL: MODEL_FILES, **(repos or {})}
        self.json_files = {
            (published.MODEL, "config.json"): MODEL_CONFIG,
            (published.GAUDI_CONFIG, "gaudi_config.json"): HABANA_CLIP,
            **(json_files or {}),
        }

    def files(self, name):
        found = self.repos[name]
        if isinstance(found, BaseException):
            raise found
        return [{"rfilename": file} for file in found]

    def dataset_info(self, name, revision=None, timeout=None):
        self.asked.append(("dataset_info", name, revision, timeout))
        return DatasetInfo(id=name, sha=revision, siblings=self.files(name), cardData=self.card)

    def model_info(self, name, revision=None, timeout=None):
        self.asked.append(("model_info", name, revision, timeout))
        return ModelInfo(id=name, sha=revision, siblings=self.files(name))

    def download(self, name, filename, revision=None, etag_timeout=None):
        self.asked.append(("download", name, filename, revision, etag_timeout))
        content = self.json_files[(name, filename)]
        if isinstance(content, BaseException):
            raise content
        path = self.tmp_path / name.replace("/", "--") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        return str(path)


@BOTH_ROUTES
def test_the_stand_in_is_asked_as_the_installed_client_is_called():
    """The calls hub_check makes, bound to the installed huggingface_hub's own signatures: the stand-in cannot
    accept a call the real client would refuse."""
    import inspect

    import huggingface_hub

    calls = {
        huggingface_hub.HfApi.dataset_info: (None, published.DATASET),
        huggingface_hub.HfApi.model_info: (None, published.MODEL),
    }
    for method, positional in calls.items():
        inspect.signature(method).bind(*positional, revision="main", timeout=hub_check.TIMEOUT)
    inspect.signature(huggingface_hub.hf_hub_download).bind(
        published.MODEL, "config.json", revision="main", etag_timeout=hub_check.TIMEOUT
    )
    for method in (StandInHub.dataset_info, StandInHub.model_info):
        assert list(inspect.signature(method).parameters) == ["self", "name", "revision", "timeout"]


@pytest.fixture
def online(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def hub_rows(hub, gaudi_config=True):
    return {row.name: row for row in hub_check.rows(gaudi_config, api=hub, download=hub.download)}


def test_the_published_names_resolve_from_file_lists_and_two_small_json_files(online, tmp_path):
    hub = StandInHub(tmp_path)
    with optimum_habana():
        rows = hub_rows(hub)
    assert [(row.result, row.name) for row in rows.values()] == [
        ("ok", "Hub: data set"),
        ("ok", "Hub: model"),
        ("ok", "Hub: Gaudi config"),
    ]
    assert rows["Hub: data set"].detail == (
        f"{published.DATASET}@{published.DATASET_REVISION[:7]}: config matching, 3 data files under matching/, "
        "no loading script"
    )
    assert rows["Hub: model"].detail == f"{published.MODEL}@main: pytorch_model.bin; config.json: BridgeTowerConfig"
    assert "use_torch_autocast true" in rows["Hub: Gaudi config"].detail
    # The published revision asked, each request bounded, and nothing downloaded but the two JSON files.
    assert ("dataset_info", published.DATASET, published.DATASET_REVISION, hub_check.TIMEOUT) in hub.asked
    downloads = [request[1:3] for request in hub.asked if request[0] == "download"]
    assert downloads == [(published.MODEL, "config.json"), (published.GAUDI_CONFIG, "gaudi_config.json")]
    assert all(request[-1] == hub_check.TIMEOUT for request in hub.asked)


@BOTH_ROUTES
def test_a_loading_script_revision_a_missing_config_and_a_model_of_another_kind_fail_their_rows(online, tmp_path):
    rows = hub_rows(StandInHub(tmp_path, repos={published.DATASET: SCRIPT_REVISION}, card={}), gaudi_config=False)
    assert rows["Hub: data set"].result == "failed"
    assert "holds the loading script newyorker_caption_contest.py: datasets 4 and later run none" in (
        rows["Hub: data set"].detail
    )
    assert list(rows) == ["Hub: data set", "Hub: model"]  # (the NVIDIA check reads no Gaudi configuration)

    other = {published.DATASET: [".gitattributes", "README.md", "ranking/train-00000-of-00001.parquet"]}
    ranking = {"configs": [{"config_name": "ranking"}]}
    rows = hub_rows(StandInHub(tmp_path, repos=other, card=ranking), gaudi_config=False)
    assert (rows["Hub: data set"].result, rows["Hub: data set"].detail) == (
        "failed",
        f"{published.DATASET}@{published.DATASET_REVISION[:7]} has no config matching (configs in its card: ranking)",
    )

    clip = {(published.MODEL, "config.json"): {"model_type": "clip"}}
    row = hub_rows(StandInHub(tmp_path, json_files=clip), gaudi_config=False)["Hub: model"]
    assert row.result == "failed" and "says model_type 'clip' (CLIPConfig), not BridgeTowerConfig's" in row.detail
    no_weights = {published.MODEL: ["README.md", "config.json"]}
    row = hub_rows(StandInHub(tmp_path, repos=no_weights), gaudi_config=False)["Hub: model"]
    assert row.result == "failed" and "holds no weights transformers loads" in row.detail
    broken = {(published.MODEL, "config.json"): "{not json"}
    row = hub_rows(StandInHub(tmp_path, json_files=broken), gaudi_config=False)["Hub: model"]
    assert row.result == "failed" and row.detail.startswith(f"{published.MODEL}@main config.json: unreadable")


@BOTH_ROUTES
def test_a_missing_repository_or_revision_fails_its_row_and_the_others_are_still_checked(online, tmp_path):
    gone = refusal(RevisionNotFoundError, "404 Client Error. Revision Not Found for url: https://huggingface.co/x")
    missing = refusal(RepositoryNotFoundError, "404 Client Error. Repository Not Found for url: https://hf.co/y")
    rows = hub_rows(StandInHub(tmp_path, repos={published.DATASET: gone, published.MODEL: missing}), False)
    data, model = rows["Hub: data set"], rows["Hub: model"]
    assert data.result == "failed" and data.detail.startswith(
        f"{published.DATASET}@{published.DATASET_REVISION[:7]}: RevisionNotFoundError: 404 Client Error."
    )
    assert model.result == "failed" and "RepositoryNotFoundError" in model.detail


def gaudi_config_row(tmp_path, content):
    hub = StandInHub(tmp_path, json_files={(published.GAUDI_CONFIG, "gaudi_config.json"): content})
    with optimum_habana():
        return hub_rows(hub)["Hub: Gaudi config"]


def test_the_gaudi_configuration_fails_without_autocast_and_warns_of_keys_gaudiconfig_ignores(online, tmp_path):
    # The keys of optimum-habana's older mixed precision (HMP): GaudiConfig 1.21 drops them, autocast stays off.
    hmp = {"use_habana_mixed_precision": True, "hmp_bf16_ops": ["linear"], "use_fused_adam": True}
    row = gaudi_config_row(tmp_path, hmp)
    assert row.result == "failed"
    assert row.detail == (
        "Habana/clip gaudi_config.json: use_torch_autocast absent (GaudiConfig's default: false): the published "
        "Gaudi command (no --bf16) would train without bf16 autocast, in fp32"
    )
    extra = {**HABANA_CLIP, "use_habana_mixed_precision": True, "optimum_version": "1.30.0"}
    row = gaudi_config_row(tmp_path, extra)
    assert row.result == "warning" and row.detail.endswith(
        "GaudiConfig ignores without a word: use_habana_mixed_precision"
    )  # (optimum_version: written by GaudiConfig itself, so known)
    off = {**HABANA_CLIP, "use_torch_autocast": False}
    row = gaudi_config_row(tmp_path, off)
    assert row.result == "failed" and "use_torch_autocast false" in row.detail


@BOTH_ROUTES
def test_offline_or_unreachable_the_rows_say_not_checked(monkeypatch, tmp_path):
    hub = StandInHub(tmp_path)
    rows = hub_rows(hub)  # the tests' HF_HUB_OFFLINE=1
    assert {(row.result, row.detail) for row in rows.values()} == {
        ("skipped", "not checked (offline): HF_HUB_OFFLINE is set")
    }
    assert len(rows) == 3 and hub.asked == []

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.repos[published.DATASET] = TimeoutError("timed out")  # (what an HTTP client's timeout is, in spirit)
    rows = hub_rows(hub)
    assert [row.result for row in rows.values()] == ["skipped"] * 3
    assert rows["Hub: model"].detail == (
        f"not checked (offline): {published.DATASET}@{published.DATASET_REVISION[:7]}: no answer within "
        f"{hub_check.TIMEOUT:.0f} s (TimeoutError)"
    )
    assert [request[0] for request in hub.asked] == ["dataset_info"]  # nothing more was asked

    # No connection and nothing cached: hf_hub_download's own error; the rows checked before it stand.
    hub = StandInHub(tmp_path, json_files={(published.MODEL, "config.json"): LocalEntryNotFoundError("no network")})
    rows = hub_rows(hub)
    assert [row.result for row in rows.values()] == ["ok", "skipped", "skipped"]
    assert rows["Hub: Gaudi config"].detail.startswith("not checked (offline): BridgeTower/")


def test_the_gaudi_check_fails_when_the_published_gaudi_configuration_would_train_in_fp32(
    online, no_fixture_builds, tmp_path, monkeypatch, capsys
):
    """Through the self-check: the stand-in put where the check finds huggingface_hub's client; every step passes."""
    import huggingface_hub

    from bridgetower_bench.tools import gaudi_check

    without_autocast = {"use_fused_adam": True, "use_fused_clip_norm": True}
    hub = StandInHub(tmp_path, json_files={(published.GAUDI_CONFIG, "gaudi_config.json"): without_autocast})
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: hub)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.download)

    def passes(step):
        step.run_dir.mkdir(parents=True)
        results = {"loader": step.expected_loader, "execution_mode": "lazy", "train_samples_per_second": 100.0}
        (step.run_dir / "train_results.json").write_text(json.dumps(results))
        return gaudi_check.self_check.Ran(0)

    probe = lambda: gaudi_check.Hpus(1, "GAUDI2", media_pipeline=None)  # noqa: E731
    with optimum_habana():
        status = gaudi_check.main(["--output_dir", str(tmp_path / "check")], probe=probe, runner=passes)
    assert status == 1
    record = json.loads((tmp_path / "check" / "gaudi_check.json").read_text())
    stack = {row["name"]: row for row in record["stack"]}
    assert [stack[name]["result"] for name in ("Hub: data set", "Hub: model", "Hub: Gaudi config")] == [
        "ok",
        "ok",
        "failed",
    ]
    assert all(row["result"] == "ok" for row in record["steps"] if row["result"] != "skipped")
    assert "would train without bf16 autocast" in capsys.readouterr().out
