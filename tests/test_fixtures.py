"""Offline fixtures: the tiny model loads and trains, the synthetic data set has the New Yorker
`matching` schema and layout, each fixture has the shape of the real artifact it stands for
(tests/published_artifacts.json), everything is reproducible, and default fixtures are built once."""

import io
import itertools
import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Image as ImageFeature
from datasets import load_dataset
from datasets.info import DatasetInfosDict
from huggingface_hub import DatasetCard, DatasetCardData
from PIL import Image

from bridgetower_bench.tools import cartoons, fixtures
from bridgetower_bench.tools.cartoons import Scene, describe, draw_cartoon, jpeg_bytes, render_scene
from bridgetower_bench.tools.fixtures import (
    ensure_default_fixtures,
    make_synthetic_dataset,
    make_tiny_model,
)
from helpers import BOTH_ROUTES, dead_pid


CAPTION = "Two houses and a tree on the left side of a city street."
SMALL_ROWS = {"train_rows": 6, "validation_rows": 3, "test_rows": 3, "rows_per_cartoon": 2}

# The real artifacts the fixtures stand for, as recorded with their sources and date: written out there rather than
# read from the module, so that a drift of either is one failing test below.
PUBLISHED = json.loads((Path(__file__).parent / "published_artifacts.json").read_text())


def card_features(dataset_info: list):
    """The features of the `matching` entry of a card's `dataset_info`, as `datasets` reads them."""
    return DatasetInfosDict.from_dataset_card_data(DatasetCardData(dataset_info=dataset_info))["matching"].features


MATCHING_FEATURES = card_features([{"config_name": "matching", "features": PUBLISHED["dataset"]["features"]}])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("dataset"), **SMALL_ROWS)


@pytest.fixture
def one_torch_thread():
    """Tiny matrices on a shared 2-core machine run far faster on one thread than on two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load(dataset_dir, tmp_path):
    return load_dataset(str(dataset_dir), "matching", cache_dir=str(tmp_path / "hf-cache"))


# --- model ---------------------------------------------------------------------------------------


def test_tiny_model_loads_offline_and_gives_a_finite_contrastive_loss(model_dir, one_torch_thread):
    from transformers import AutoImageProcessor, AutoTokenizer, BridgeTowerForContrastiveLearning

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    model = BridgeTowerForContrastiveLearning.from_pretrained(model_dir)

    assert type(tokenizer).__name__ == "RobertaTokenizerFast"
    assert model.config.text_config.vocab_size == len(tokenizer)
    assert processor.image_mean == list(fixtures.CLIP_MEAN) and processor.image_std == list(fixtures.CLIP_STD)
    assert processor.size == {"shortest_edge": 294} and processor.crop_size == {"shortest_edge": 294}

    images, captions = zip(*(draw_cartoon(np.random.default_rng(i), 700, 560) for i in range(2)))
    pixels = processor(list(images), return_tensors="pt")["pixel_values"]
    text = tokenizer(list(captions), padding="max_length", max_length=32, return_tensors="pt")
    assert pixels.shape == (2, 3, 294, 294)
    with torch.no_grad():
        out = model(
            input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels, return_loss=True
        )
    assert torch.isfinite(out.loss)


@BOTH_ROUTES
def test_the_tiny_model_has_the_published_models_configuration_class_and_files(model_dir):
    from transformers import AutoConfig

    real = PUBLISHED["model"]
    assert sorted(p.name for p in model_dir.iterdir()) == real["files"]
    config = AutoConfig.from_pretrained(model_dir)
    assert (type(config).__name__, config.model_type) == (real["config_class"], real["model_type"])


@BOTH_ROUTES
def test_tokenizer_round_trips_a_caption_with_roberta_special_tokens(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(CAPTION)["input_ids"]
    assert (ids[0], ids[-1], tokenizer.pad_token_id) == (0, 2, 1)
    assert tokenizer.decode(ids, skip_special_tokens=True) == CAPTION
    assert len(ids) < len(CAPTION) // 2  # merges learned from the captions, not one token per byte


def test_same_seed_gives_identical_model_and_parquet_files_and_another_seed_others(model_dir, dataset_dir, tmp_path):
    again = make_tiny_model(tmp_path / "again")
    other = make_tiny_model(tmp_path / "other", seed=1)
    for name in (fixtures.MODEL_WEIGHTS, "tokenizer.json", "vocab.json", "config.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert (other / fixtures.MODEL_WEIGHTS).read_bytes() != (model_dir / fixtures.MODEL_WEIGHTS).read_bytes()

    again = make_synthetic_dataset(tmp_path / "again-dataset", **SMALL_ROWS)
    other = make_synthetic_dataset(tmp_path / "other-dataset", **SMALL_ROWS, seed=1)
    shard = "matching/train-00001-of-00002.parquet"
    assert (again / shard).read_bytes() == (dataset_dir / shard).read_bytes()
    assert (other / shard).read_bytes() != (dataset_dir / shard).read_bytes()


def test_large_config_is_bridgetower_large_with_about_866m_parameters():
    config = fixtures.bridgetower_config(large=True, vocab_size=50265)
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (1024, 16, 6)
    assert (config.contrastive_hidden_size, config.logit_scale_init_value) == (512, 2.6592)
    assert config.share_cross_modal_transformer_layers and config.link_tower_type == "add"
    text, vision = config.text_config, config.vision_config
    assert (text.num_hidden_layers, text.intermediate_size, text.vocab_size) == (24, 4096, 50265)
    assert (vision.num_hidden_layers, vision.hidden_size, vision.image_size, vision.patch_size) == (24, 1024, 294, 14)
    assert abs(fixtures.parameter_count(config) - 866e6) < 2e6


def test_default_fixture_model_sees_bridgetower_images_through_few_coarse_patches(tmp_path, one_torch_thread):
    """The local preset's model: 294-px inputs (the image pipelines' full work), 7 x 7 patches of 42 px and
    one layer per tower, so a CPU training step costs less than loading its images."""
    from transformers import BridgeTowerForContrastiveLearning

    model = BridgeTowerForContrastiveLearning.from_pretrained(
        make_tiny_model(tmp_path, **fixtures.DEFAULT_MODEL_OPTIONS)
    )
    config = model.config
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (294, 42)
    layers = (config.text_config.num_hidden_layers, config.vision_config.num_hidden_layers, config.num_hidden_layers)
    assert layers == (1, 1, 1)
    ids, pixels = torch.tensor([[0, 100, 101, 2]]), torch.zeros(1, 3, 294, 294)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, output_hidden_states=True)
    assert out.image_embeds.shape == (1, 32)
    # vision tokens, sequence first (nn.MultiheadAttention layout): 49 patches and the class token
    assert out.hidden_states[1][0].shape == (7 * 7 + 1, 1, 64)


@pytest.mark.parametrize(
    "options, named",
    [
        ({"patch_size": 0}, "patch_size"),
        ({"layers": 0}, "layers"),
        ({"layers": 1.5}, "layers"),
        ({"large": True, "layers": 3}, "layers"),
        ({"image_size": 40, "patch_size": 42}, "image_size"),
    ],
)
def test_bad_model_shape_options_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named):
        fixtures.bridgetower_config(vocab_size=100, **{"large": False, **options})


def test_cli_model_options_default_to_the_default_fixture_and_keep_large_at_its_own_shape(capsys):
    def options(*argv):
        return fixtures._model_options(fixtures._parse_args(["model", *argv]))

    assert options() == fixtures.DEFAULT_MODEL_OPTIONS
    assert options("--layers", "2", "--patch-size", "14") == dict(
        fixtures.DEFAULT_MODEL_OPTIONS, layers=2, patch_size=14
    )
    assert options("--large") == {"seed": 0, "image_size": 294, "large": True}
    with pytest.raises(SystemExit):
        fixtures._parse_args(["model", "--large", "--layers", "2"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m bridgetower_bench.tools.fixtures: error: --layers sets the tiny model's depth; "
        "BridgeTower Large's (--large) is fixed"
    )


# --- data set ------------------------------------------------------------------------------------


def test_dataset_is_the_matching_config_of_embedded_jpegs_with_cartoons_on_several_rows_of_one_split(
    dataset_dir, tmp_path
):
    dataset = _load(dataset_dir, tmp_path)
    assert {split: len(dataset[split]) for split in dataset} == {"train": 6, "validation": 3, "test": 3}
    for split in dataset:
        assert dataset[split].features == MATCHING_FEATURES

    # images: embedded JPEGs of realistic size
    low, high = cartoons.IMAGE_SIDE_RANGE
    for image in dataset["train"]["image"]:
        assert image.mode == "RGB" and low <= image.width <= high and low <= image.height <= high
    dataset = dataset.cast_column("image", ImageFeature(decode=False))
    for row in dataset["train"]:
        assert row["image"]["bytes"][:2] == b"\xff\xd8"

    # each cartoon fills several rows, and the splits use disjoint cartoons
    first, second = dataset["train"][0], dataset["train"][1]
    assert first["contest_number"] == second["contest_number"]
    assert first["image"]["bytes"] == second["image"]["bytes"]
    assert first["image_description"] == second["image_description"]
    assert first["instance_id"] != second["instance_id"]
    assert len(first["caption_choices"]) == 5 and first["label"] in "ABCDE"
    contests = [set(dataset[split]["contest_number"]) for split in ("train", "validation", "test")]
    assert [len(c) for c in contests] == [3, 2, 2]
    assert not (contests[0] & contests[1] or contests[0] & contests[2] or contests[1] & contests[2])


@BOTH_ROUTES
def test_the_synthetic_data_set_has_the_published_revisions_files_card_and_column_types(dataset_dir, tmp_path):
    real = PUBLISHED["dataset"]
    assert sorted(str(p.relative_to(dataset_dir)) for p in dataset_dir.rglob("*.parquet")) == real["data_files"]
    card = DatasetCard.load(dataset_dir / "README.md").data
    assert card.configs == real["configs"]
    (info,) = card.dataset_info  # a list of configurations, as on the Hub
    assert list(info) == real["dataset_info_keys"]
    assert [list(split) for split in info["splits"]] == [real["split_keys"]] * len(real["splits"])
    assert [split["name"] for split in info["splits"]] == real["splits"]
    # column names, order and types, as `datasets` reads both cards, and as a run loads the parquet files
    assert card_features(card.dataset_info) == MATCHING_FEATURES
    assert list(MATCHING_FEATURES) == [feature["name"] for feature in real["features"]]
    assert all(split.features == MATCHING_FEATURES for split in _load(dataset_dir, tmp_path).values())


@pytest.mark.parametrize(
    "build, options, named",
    [(make_tiny_model, {"corpus": ["", "  "]}, "corpus")]  # an empty tokenizer corpus
    + [(make_synthetic_dataset, {**SMALL_ROWS, name: 0}, name) for name in SMALL_ROWS],  # non-positive row counts
)
def test_an_empty_corpus_or_non_positive_row_counts_are_refused_by_name(tmp_path, build, options, named):
    with pytest.raises(ValueError, match=named):
        build(tmp_path, **options)


# --- cartoons and captions -----------------------------------------------------------------------


def test_caption_says_what_is_drawn_and_different_contents_always_get_different_captions():
    assert describe(Scene("street", "left", (("house", 2), ("tree", 1)))) == CAPTION
    scenes = [
        Scene(setting, region, things)
        for setting, region in itertools.product(cartoons.SETTINGS, cartoons.REGIONS)
        for n_kinds in (1, 2)
        for kinds in itertools.permutations(cartoons.THINGS, n_kinds)
        for counts in itertools.product((1, 2, 3), repeat=n_kinds)
        if sum(counts) <= cartoons.MAX_OBJECTS
        for things in [tuple(zip(kinds, counts))]
    ]
    # Two kinds listed in another order are the same contents; captions may differ for those,
    # so compare the sets of contents per caption instead of counting captions.
    contents_by_caption = {}
    for scene in scenes:
        contents = (scene.setting, scene.region, frozenset(scene.things))
        contents_by_caption.setdefault(describe(scene), set()).add(contents)
    assert all(len(contents) == 1 for contents in contents_by_caption.values())


def test_cartoons_have_the_requested_size_are_deterministic_and_draw_objects_in_the_region_the_caption_names():
    def ink(region):
        scene = Scene("room", region, (("house", 1),))
        pixels = np.asarray(render_scene(scene, np.random.default_rng(7), 800, 600).convert("L"), dtype=float)
        return 255.0 - pixels

    extra = np.clip(ink("left") - ink("right"), 0, None)  # ink the left-side house adds
    assert extra[:, :400].sum() > 5 * extra[:, 400:].sum()

    image, caption = draw_cartoon(np.random.default_rng(3), 640, 520)
    again, caption_again = draw_cartoon(np.random.default_rng(3), 640, 520)
    assert image.size == (640, 520) and image.mode == "RGB"
    assert caption == caption_again and np.array_equal(np.asarray(image), np.asarray(again))
    encoded = jpeg_bytes(image)
    assert Image.open(io.BytesIO(encoded)).format == "JPEG"


# --- Gaudi config, default fixtures, command line ------------------------------------------------


def test_ensure_default_fixtures_builds_once_ignores_incomplete_leftovers_and_writes_habana_clips_config(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(fixtures, "DEFAULT_DATASET_OPTIONS", {**SMALL_ROWS, "seed": 0})
    root = tmp_path / "fixtures"
    half_built = root / fixtures.MODEL_DIR_NAME  # e.g. an interrupted copy: no completion marker
    half_built.mkdir(parents=True)
    (half_built / "config.json").write_text("{}")
    outdated = root / fixtures.GAUDI_CONFIG_DIR_NAME  # complete, but by an older generator
    outdated.mkdir()
    (outdated / "gaudi_config.json").write_text("{}")
    (outdated / fixtures.MARKER_FILE).write_text(json.dumps({**fixtures.fixture_params("gaudi_config"), "version": 0}))
    stale = root / f"{fixtures.DATASET_DIR_NAME}.partial-{socket.gethostname()}-{dead_pid()}.abc123"
    stale.mkdir()
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))

    paths = ensure_default_fixtures(root)

    assert set(paths) == {"model", "dataset", "gaudi_config"}
    assert not stale.exists()
    assert (paths["model"] / fixtures.MODEL_WEIGHTS).exists()
    assert len(_load(paths["dataset"], tmp_path)["train"]) == SMALL_ROWS["train_rows"]
    # the Gaudi configuration stand-in: Habana/clip's one file, its keys and values
    real = PUBLISHED["gaudi_config"]
    written = sorted(p.name for p in paths["gaudi_config"].iterdir() if p.name != fixtures.MARKER_FILE)
    assert written == [real["file"]]
    assert json.loads((paths["gaudi_config"] / real["file"]).read_text()) == real["content"]
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in paths.values())

    stamps = {p: p.stat().st_mtime_ns for d in paths.values() for p in d.rglob("*")}
    assert ensure_default_fixtures(root) == paths
    assert {p: p.stat().st_mtime_ns for d in paths.values() for p in d.rglob("*")} == stamps

    monkeypatch.setenv(fixtures.FIXTURES_ENV, str(tmp_path / "from-env"))
    assert fixtures.default_fixtures_root() == tmp_path / "from-env"


def test_cli_writes_a_dataset_prints_the_image_spread_reuses_it_and_refuses_a_non_positive_row_count(tmp_path, capsys):
    rows = "--train-rows 2 --validation-rows 1 --test-rows 1 --rows-per-cartoon 1".split()
    argv = ["--out", str(tmp_path), *rows, "dataset"]
    fixtures.main(argv)
    printed = capsys.readouterr().out
    assert str(tmp_path / fixtures.DATASET_DIR_NAME) in printed and "built in" in printed and "JPEG" in printed
    assert fixtures.is_complete(
        tmp_path / fixtures.DATASET_DIR_NAME,
        fixtures.fixture_params("dataset", train_rows=2, validation_rows=1, test_rows=1, rows_per_cartoon=1, seed=0),
    )
    fixtures.main(argv)
    assert "already complete" in capsys.readouterr().out

    with pytest.raises(SystemExit):  # a non-positive row count
        fixtures.main(["--train-rows", "0", "dataset"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m bridgetower_bench.tools.fixtures: error: --train-rows must be a positive integer, got 0"
    )


def test_exif_rotated_cartoons_are_stored_transposed_and_decode_upright(tmp_path):
    options = dict(train_rows=6, validation_rows=1, test_rows=1, rows_per_cartoon=2, image_side_range=(120, 200))
    plain = load_dataset(
        str(fixtures.make_synthetic_dataset(tmp_path / "plain", **options)), "matching", split="train"
    )
    rotated_dir = fixtures.make_synthetic_dataset(tmp_path / "rotated", exif_rotated_every=2, **options)
    rotated = load_dataset(str(rotated_dir), "matching", split="train")
    raw = rotated.cast_column("image", ImageFeature(decode=False))
    tags = [Image.open(io.BytesIO(row["image"]["bytes"])).getexif().get(0x0112) for row in raw]
    assert tags == [2, 2, None, None, 3, 3]  # cartoons 0 and 2 of the split, orientations in turn
    for upright, expected in zip(rotated["image"], plain["image"]):  # datasets turns them upright on decoding
        assert upright.size == expected.size
        difference = np.abs(np.asarray(upright, dtype=float) - np.asarray(expected.convert(upright.mode), dtype=float))
        assert difference.mean() < 3  # the same picture, encoded once more
    with pytest.raises(ValueError, match="exif_rotated_every"):
        fixtures.make_synthetic_dataset(tmp_path / "bad", exif_rotated_every=-1, **options)
