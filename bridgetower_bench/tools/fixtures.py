"""Offline fixtures: a random-weight BridgeTower model, a synthetic New Yorker-shaped data set
and a local copy of the ``Habana/clip`` Gaudi configuration.

Nothing here touches the network, so the scripts, tests and benchmarks can run on machines
that cannot reach the Hugging Face Hub.

* ``make_tiny_model`` writes a model directory (config, weights as ``pytorch_model.bin`` as the published
  model has them, a RoBERTa-style byte-level BPE tokenizer trained locally, a ``BridgeTowerImageProcessor``
  config) that the ``from_pretrained`` methods load offline. ``large=True`` gives the BridgeTower Large shape
  (about 866 M parameters) with random weights, for accelerator benchmarks.
* ``make_synthetic_dataset`` writes the on-disk layout and column schema of the New Yorker
  caption contest ``matching`` config at the pinned revision: its parquet file names, card and
  column types, with embedded JPEG line-art cartoons.
  Each caption (``image_description``) is derived from what is drawn, so a contrastive model
  can learn to match captions to pictures.
* ``make_gaudi_config`` writes ``gaudi_config.json`` as ``Habana/clip`` has it.

``tests/published_artifacts.json`` describes the real three, with sources and date; a test holds each
fixture against it.
* ``ensure_default_fixtures`` builds the three defaults once under a cache directory;
  ``script_flags`` / ``script_arguments`` are the flags of a script run on them.

Command line: ``python -m bridgetower_bench.tools.fixtures --help``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
from PIL import Image

from bridgetower_bench import published
from bridgetower_bench.output_dir.atomic_files import remove_abandoned, staged_directory
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.tools.cartoons import (
    IMAGE_SIDE_RANGE,
    MIN_IMAGE_SIDE,
    SETTING_PREPOSITIONS,
    SETTINGS,
    THINGS,
    Scene,
    describe,
    exif_oriented_jpeg_bytes,
    jpeg_bytes,
    render_scene,
    sample_image_size,
    sample_scene,
)


# ---------------------------------------------------------------------------------------------
# Constants shared by the fixtures
# ---------------------------------------------------------------------------------------------

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # ids 0..4, RoBERTa's order
TOKENIZER_TARGET_VOCAB = 2048

HABANA_CLIP_GAUDI_CONFIG = {"use_fused_adam": True, "use_fused_clip_norm": True, "use_torch_autocast": True}

MODEL_WEIGHTS = "pytorch_model.bin"  # as the published model has them
MODEL_DIR_NAME = "tiny-bridgetower"
LARGE_MODEL_DIR_NAME = "bridgetower-large-random"
DATASET_DIR_NAME = "newyorker-matching-synthetic"
GAUDI_CONFIG_DIR_NAME = "gaudi-config-clip"
DATASET_CONFIG_NAME = published.DATASET_CONFIG  # the published data set's layout
SPLITS = ("train", "validation", "test")
# Parquet files per split, as the published revision has them (`matching/train-00000-of-00002.parquet`, ...).
SHARDS = {"train": 2, "validation": 1, "test": 1}

# Written last into a fixture directory before it is renamed into place: its presence, with
# the build parameters, is what marks a directory as complete.
MARKER_FILE = "fixture_info.json"
FIXTURES_ENV = "BRIDGETOWER_BENCH_FIXTURES"


# ---------------------------------------------------------------------------------------------
# The synthetic New Yorker `matching` data set
# ---------------------------------------------------------------------------------------------

JOKE_TEMPLATES = (
    "I told you the {thing} would follow us home.",
    "Honestly, the {thing} was here when we moved in.",
    "Don't look now, but the {thing} is judging us.",
    "We agreed the {thing} was a temporary arrangement.",
    "It's not a {thing}, it's a lifestyle.",
    "My therapist says the {thing} is a boundary issue.",
    "Technically, the {thing} has seniority.",
    "Just act natural and maybe the {thing} won't notice.",
    "The realtor called the {thing} a charming original feature.",
    "I liked it better when the {thing} was only on weekends.",
)
UNCANNY_TEMPLATES = (
    "Nobody seems surprised that there is a {thing} {where}.",
    "The {thing} looks far too comfortable {where}.",
    "A {thing} does not belong {where}, yet everyone acts as if it does.",
)
QUESTION_TEMPLATES = ("Why is there a {thing} {where}?", "Who brought the {thing}?")
CHOICE_LETTERS = "ABCDE"


def _features():
    """The column schema of the New Yorker caption contest `matching` config. There,
    `caption_choices` lists the five candidate captions and `label` is the letter of the right one."""
    from datasets import Features, Sequence, Value
    from datasets import Image as ImageFeature

    text = Value("string")
    return Features(
        {
            "image": ImageFeature(),
            "contest_number": Value("int32"),
            "image_location": text,
            "image_description": text,
            "image_uncanny_description": text,
            "entities": Sequence(text),
            "questions": Sequence(text),
            "caption_choices": Sequence(text),
            "from_description": text,
            "label": text,
            "n_tokens_label": Value("int32"),
            "instance_id": text,
        }
    )


def _joke(rng: np.random.Generator, kind: str) -> str:
    return JOKE_TEMPLATES[int(rng.integers(len(JOKE_TEMPLATES)))].format(thing=THINGS[kind][0])


def _matching_rows(rng: np.random.Generator, scene: Scene, contest_number: int, image: dict, n_rows: int):
    """`n_rows` rows for one cartoon: same picture and description, different choices, label and id."""
    setting = SETTINGS[scene.setting]
    where = f"{SETTING_PREPOSITIONS[scene.setting]} {setting}"
    kinds = [kind for kind, _ in scene.things]
    description = describe(scene)
    uncanny = UNCANNY_TEMPLATES[int(rng.integers(len(UNCANNY_TEMPLATES)))].format(
        thing=THINGS[kinds[0]][0], where=where
    )
    entities = [f"https://en.wikipedia.org/wiki/{THINGS[kind][2]}" for kind in kinds]
    questions = [q.format(thing=THINGS[kind][0], where=where) for kind in kinds for q in QUESTION_TEMPLATES]
    others = [kind for kind in THINGS if kind not in kinds]
    for _ in range(n_rows):
        label = int(rng.integers(len(CHOICE_LETTERS)))
        choices = [_joke(rng, str(rng.choice(others))) for _ in CHOICE_LETTERS]
        choices[label] = _joke(rng, str(rng.choice(kinds)))
        listed = " ".join(f"{letter}: {choice}" for letter, choice in zip(CHOICE_LETTERS, choices))
        yield {
            "image": image,
            "contest_number": contest_number,
            "image_location": setting,
            "image_description": description,
            "image_uncanny_description": uncanny,
            "entities": entities,
            "questions": questions,
            "caption_choices": choices,
            "from_description": (
                f"scene: {setting} description: {description} uncanny: {uncanny} "
                f"entities: {', '.join(THINGS[kind][2] for kind in kinds)}. choices {listed}"
            ),
            "label": CHOICE_LETTERS[label],
            "n_tokens_label": 1,
            "instance_id": rng.bytes(16).hex(),
        }


def _split_rows(
    seed: int,
    split_index: int,
    n_rows: int,
    rows_per_cartoon: int,
    first_contest: int,
    side_range: tuple[int, int],
    stroke_scale: float,
    exif_rotated_every: int = 0,
) -> list[dict]:
    """Rows of one split. Each cartoon has its own generator, so changing a row count only
    adds or removes cartoons at the end instead of redrawing all of them. With `exif_rotated_every` N,
    cartoons 0, N, 2N, ... are stored transposed with an EXIF orientation tag (2..8 in turn)."""
    rows: list[dict] = []
    for cartoon in range(math.ceil(n_rows / rows_per_cartoon)):
        rng = np.random.default_rng([seed, split_index, cartoon])
        width, height = sample_image_size(rng, side_range)
        scene = sample_scene(rng)
        contest_number = first_contest + cartoon
        picture = render_scene(scene, rng, width, height, stroke_scale)
        if exif_rotated_every and cartoon % exif_rotated_every == 0:
            encoded = exif_oriented_jpeg_bytes(picture, 2 + (cartoon // exif_rotated_every) % 7)
        else:
            encoded = jpeg_bytes(picture)
        image = {"bytes": encoded, "path": f"{contest_number}.jpeg"}
        rows.extend(_matching_rows(rng, scene, contest_number, image, min(rows_per_cartoon, n_rows - len(rows))))
    return rows


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_side_range(side_range) -> tuple[int, int]:
    """`side_range` as (low, high) ints with MIN_IMAGE_SIDE <= low <= high, or a ValueError naming it."""
    try:
        low, high = side_range
    except (TypeError, ValueError):
        raise ValueError(f"image_side_range must be a (min, max) pair of pixel counts, got {side_range!r}") from None
    if (
        any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in (low, high))
        or not MIN_IMAGE_SIDE <= low <= high
    ):
        raise ValueError(
            f"image_side_range must be two integers with {MIN_IMAGE_SIDE} <= min <= max, got {side_range!r}"
        )
    return int(low), int(high)


def make_synthetic_dataset(
    out_dir,
    *,
    train_rows: int = 192,
    validation_rows: int = 48,
    test_rows: int = 48,
    rows_per_cartoon: int = 4,
    seed: int = 0,
    image_side_range: tuple[int, int] = IMAGE_SIDE_RANGE,
    stroke_scale: float = 1.0,
    exif_rotated_every: int = 0,
) -> Path:
    """Write a New Yorker `matching`-shaped data set of synthetic cartoons to `out_dir`.

    Layout as the published revision's: ``matching/{split}-0000i-of-0000n.parquet`` (SHARDS; embedded
    JPEG bytes) and a README.md whose YAML declares the ``matching`` config and its ``dataset_info``, so
    ``datasets.load_dataset(out_dir, "matching")`` works offline. Splits use disjoint cartoons; each cartoon fills `rows_per_cartoon` rows.

    `image_side_range` bounds each side of a cartoon in pixels and `stroke_scale` multiplies the
    pen width. The defaults give New Yorker-like scans, whose thin strokes fade to faint grey when
    shrunk to a small model's image size (112 px): a tiny model trained from scratch then learns
    little beyond the setting. A learning test wants small cartoons (e.g. 160-260 px: ten times
    faster to draw) with bold strokes (e.g. 2.0).

    `exif_rotated_every` N > 0 stores every Nth cartoon of each split (the first included) as a phone
    photo or scan may be: transposed, with the EXIF orientation tag (2..8 in turn) that turns it upright.
    """
    import datasets

    counts = {
        "train_rows": train_rows,
        "validation_rows": validation_rows,
        "test_rows": test_rows,
        "rows_per_cartoon": rows_per_cartoon,
    }
    for name, value in counts.items():
        _check_positive(name, value)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    side_range = _check_side_range(image_side_range)
    if isinstance(exif_rotated_every, bool) or not isinstance(exif_rotated_every, int) or exif_rotated_every < 0:
        raise ValueError(f"exif_rotated_every must be a non-negative integer, got {exif_rotated_every!r}")
    if isinstance(stroke_scale, bool) or not isinstance(stroke_scale, (int, float)) or not 0 < stroke_scale <= 10:
        raise ValueError(f"stroke_scale must be a number in (0, 10], got {stroke_scale!r}")
    out = Path(out_dir)
    (out / DATASET_CONFIG_NAME).mkdir(parents=True, exist_ok=True)
    for stale in (out / DATASET_CONFIG_NAME).glob("*.parquet"):  # the split globs would pick them up
        stale.unlink()
    features = _features()
    split_infos = {}
    first_contest = 500
    bars_were_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one bar per tiny shard is noise
    try:
        for index, (split, n_rows) in enumerate(zip(SPLITS, (train_rows, validation_rows, test_rows))):
            rows = _split_rows(
                seed, index, n_rows, rows_per_cartoon, first_contest, side_range, stroke_scale, exif_rotated_every
            )
            first_contest += math.ceil(n_rows / rows_per_cartoon)
            columns = {name: [row[name] for row in rows] for name in features}
            dataset = datasets.Dataset.from_dict(columns, features=features)
            shards = min(SHARDS[split], len(dataset))
            for shard in range(shards):
                name = f"{split}-{shard:05d}-of-{shards:05d}.parquet"
                dataset.shard(shards, shard, contiguous=True).to_parquet(str(out / DATASET_CONFIG_NAME / name))
            split_infos[split] = datasets.SplitInfo(split, num_bytes=dataset.data.nbytes, num_examples=len(rows))
    finally:
        if not bars_were_disabled:
            datasets.enable_progress_bars()
    _write_dataset_card(out, features, split_infos)
    return out


def _write_dataset_card(out: Path, features, split_infos: dict) -> None:
    """README.md with the YAML header that `datasets` reads: the config, its files and `dataset_info` (features,
    splits with their sizes, download and data set sizes), a list of configs as on the Hub."""
    from datasets import DatasetInfo, SplitDict
    from datasets.info import DatasetInfosDict
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCardData

    splits = SplitDict()
    for info in split_infos.values():
        splits.add(info)
    card = DatasetCardData()
    info = DatasetInfo(
        features=features,
        splits=splits,
        config_name=DATASET_CONFIG_NAME,
        download_size=sum(f.stat().st_size for f in (out / DATASET_CONFIG_NAME).glob("*.parquet")),
        dataset_size=sum(split.num_bytes for split in split_infos.values()),
    )
    DatasetInfosDict({DATASET_CONFIG_NAME: info}).to_dataset_card_data(card)
    card["dataset_info"] = [card["dataset_info"]]  # one config written as the Hub's card lists its many
    data_files = [{"split": split, "path": f"{DATASET_CONFIG_NAME}/{split}-*"} for split in split_infos]
    MetadataConfigs({DATASET_CONFIG_NAME: {"data_files": data_files}}).to_dataset_card_data(card)
    body = (
        "# Synthetic New Yorker caption contest (`matching` layout)\n\n"
        "Generated offline by `python -m bridgetower_bench.tools.fixtures dataset`. Same columns and file\n"
        "layout as the `matching` config of `jmhessel/newyorker_caption_contest`, with line-art\n"
        "cartoons whose `image_description` says what is drawn (objects, how many, where, setting).\n"
    )
    (out / "README.md").write_text(f"---\n{card.to_yaml()}\n---\n\n{body}", encoding="utf-8")


def image_spread(dataset_dir) -> dict:
    """Width, height and JPEG size ranges of the distinct images in a data set written here."""
    import pyarrow.parquet as pq

    widths, heights, kilobytes = [], [], []
    seen = set()  # (a cartoon's rows may span two shards of a split; contest numbers differ across splits)
    for shard in sorted((Path(dataset_dir) / DATASET_CONFIG_NAME).glob("*.parquet")):
        for cell in pq.read_table(shard, columns=["image", "contest_number"]).to_pylist():
            if cell["contest_number"] in seen:
                continue
            seen.add(cell["contest_number"])
            data = cell["image"]["bytes"]
            with Image.open(io.BytesIO(data)) as img:
                widths.append(img.width)
                heights.append(img.height)
            kilobytes.append(len(data) / 1024)
    if not widths:
        raise ValueError(f"no parquet shards with images under {Path(dataset_dir) / DATASET_CONFIG_NAME}")
    return {
        "images": len(widths),
        "width": (min(widths), max(widths)),
        "height": (min(heights), max(heights)),
        "portrait": sum(h > w for w, h in zip(widths, heights)),
        "jpeg_kb": (min(kilobytes), float(np.median(kilobytes)), max(kilobytes)),
    }


# ---------------------------------------------------------------------------------------------
# Model, tokenizer and image processor
# ---------------------------------------------------------------------------------------------

GENERIC_ENGLISH = (
    "The quick brown fox jumps over the lazy dog.",
    "She said that the meeting would start at nine o'clock in the morning.",
    "A cartoon is a drawing that tells a joke in a single picture.",
    "We walked along the river until the sun went down behind the hills.",
    "Please remember to bring your umbrella, because it might rain later today.",
    "The committee could not agree on the budget, so the decision was postponed.",
    "He bought bread, cheese, apples and a bottle of milk at the corner shop.",
    "Everyone laughed when the dog stole the sandwich from the picnic table.",
    "This is one of the most interesting books I have read in years.",
    "They moved to the city last spring and found a small apartment near the park.",
    "What do you think about the new restaurant on the other side of town?",
    "The children were playing in the garden while their parents talked inside.",
    "Our train was delayed for an hour, and nobody told us why.",
    "If you have any questions, do not hesitate to ask the person at the desk.",
    "The old man sat on the bench and fed the pigeons every afternoon.",
    "It was a dark and stormy night, and the wind howled through the trees.",
)


def default_tokenizer_corpus(seed: int = 0, n_descriptions: int = 3000) -> list[str]:
    """Text for training the fixture tokenizer: sampled cartoon descriptions, every string the
    data set uses, and some generic English so that ordinary sentences tokenize sensibly."""
    rng = np.random.default_rng([seed, 99])
    corpus = [describe(sample_scene(rng)) for _ in range(n_descriptions)]
    for kind, (singular, plural, entity) in THINGS.items():
        corpus += [template.format(thing=singular) for template in JOKE_TEMPLATES]
        for key, setting in SETTINGS.items():
            where = f"{SETTING_PREPOSITIONS[key]} {setting}"
            corpus += [t.format(thing=singular, where=where) for t in UNCANNY_TEMPLATES + QUESTION_TEMPLATES]
        corpus += [f"Two {plural} and three {plural}.", f"https://en.wikipedia.org/wiki/{entity}"]
    corpus += ["scene: description: uncanny: entities: choices A: B: C: D: E:"]
    corpus += list(GENERIC_ENGLISH)
    return corpus


def _train_tokenizer(corpus: Iterable[str], out_dir: Path):
    """Train a byte-level BPE on `corpus` and save it as the published model's tokenizer is saved: `tokenizer.json`
    and `vocab.json` only (RoBERTa's, found through the model's configuration; no `merges.txt`, no
    `tokenizer_config.json`, so no model_max_length)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    texts = [text for text in corpus if text.strip()]
    if not texts:
        raise ValueError("the tokenizer corpus is empty: pass some caption text, or corpus=None for the default")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts,
        vocab_size=TOKENIZER_TARGET_VOCAB,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        bpe.save_model(tmp)  # vocab.json and merges.txt, loaded by directory: 5.x ignores vocab_file= and merges_file=
        tokenizer = RobertaTokenizerFast.from_pretrained(tmp)
        shutil.copyfile(os.path.join(tmp, "vocab.json"), out_dir / "vocab.json")
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    return tokenizer


def bridgetower_config(
    *,
    large: bool,
    vocab_size: int,
    image_size: int = 294,
    patch_size: int = 14,
    layers: int = 2,
    dropout: float | None = None,
):
    """A valid BridgeTowerConfig: BridgeTower Large's shape, or a tiny one for CPU tests.

    BridgeTower needs equal text, vision and cross-modal hidden sizes, vision heads = hidden // 64,
    and as many text as vision layers (the top `num_hidden_layers` of each feed the cross-modal ones).
    The tiny shape has hidden size 64 and `layers` text, vision and cross-modal layers each; Large's
    layer counts are fixed (24, 24, 6). `patch_size` is the vision tower's patch side (BridgeTower's is
    14). `dropout` sets the hidden and attention dropout of the text encoder and the cross-modal layers
    (the vision encoder has none); None keeps BridgeTower's default, 0.1.
    """
    from transformers import BridgeTowerConfig

    _check_positive("patch_size", patch_size)
    _check_positive("layers", layers)
    if large:
        if layers != 2:
            raise ValueError(f"layers sets the tiny model's depth; BridgeTower Large's is fixed, got layers={layers}")
        hidden, heads, cross_layers, uni_layers, intermediate, contrastive = 1024, 16, 6, 24, 4096, 512
    else:
        hidden, heads, cross_layers, uni_layers, intermediate, contrastive = 64, 2, layers, layers, 128, 32
    if image_size < patch_size:
        raise ValueError(f"image_size must be at least the patch size {patch_size}, got {image_size}")
    _check_dropout(dropout)
    dropout_options = {}
    if dropout is not None:
        dropout_options = {"hidden_dropout_prob": float(dropout), "attention_probs_dropout_prob": float(dropout)}
    return BridgeTowerConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=cross_layers,
        contrastive_hidden_size=contrastive,
        logit_scale_init_value=2.6592,
        link_tower_type="add",
        share_cross_modal_transformer_layers=True,
        share_link_tower_layers=False,
        init_layernorm_from_vision_encoder=False,
        tie_word_embeddings=False,
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "num_hidden_layers": uni_layers,
            "num_attention_heads": heads,
            "intermediate_size": intermediate,
            "max_position_embeddings": 514,
            "type_vocab_size": 1,
            "pad_token_id": 1,
            "bos_token_id": 0,
            "eos_token_id": 2,
            **dropout_options,
        },
        vision_config={
            "hidden_size": hidden,
            "num_hidden_layers": uni_layers,
            "patch_size": patch_size,
            "image_size": image_size,
            "share_layernorm": False,
            "remove_last_layer": False,
        },
    )


def _check_dropout(dropout) -> None:
    if dropout is not None and (
        isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0
    ):
        raise ValueError(f"dropout must be a probability in [0, 1) or None, got {dropout!r}")


def parameter_count(config) -> int:
    """Parameters of BridgeTowerForContrastiveLearning for `config`, counted without allocating them."""
    import torch
    from transformers import BridgeTowerForContrastiveLearning

    with torch.device("meta"):
        model = BridgeTowerForContrastiveLearning(config)
    return sum(p.numel() for p in model.parameters())


def _save_image_processor(out_dir: Path, image_size: int) -> None:
    from transformers import BridgeTowerImageProcessor

    BridgeTowerImageProcessor(
        size={"shortest_edge": image_size},
        do_center_crop=True,
        crop_size={"shortest_edge": image_size},  # BridgeTower's crop reads this key: a square crop
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    ).save_pretrained(str(out_dir))


def make_tiny_model(
    out_dir,
    *,
    seed: int = 0,
    image_size: int = 294,
    patch_size: int = 14,
    layers: int = 2,
    large: bool = False,
    corpus: Iterable[str] | None = None,
    dropout: float | None = None,
    vision_position_scale: float = 1.0,
) -> Path:
    """Write a random-weight BridgeTowerForContrastiveLearning directory, loadable offline.

    Tiny by default (hidden 64, `layers` text, vision and cross-modal layers each, 14-px patches);
    `large=True` gives BridgeTower Large's shape (~866 M parameters, vocabulary 50265). The default
    fixture (DEFAULT_MODEL_OPTIONS) is shallower and coarser still, see there. The tokenizer is a
    byte-level BPE trained on `corpus` (default: `default_tokenizer_corpus(seed)`); the tiny model's
    text vocabulary is exactly the tokenizer's. Same seed, same files.

    Two options make the random model learnable from scratch in a few hundred CPU steps (the
    defaults keep BridgeTower's initialisation):

    * `dropout` (text and cross-modal layers; None keeps 0.1) -- use 0. At initialisation every
      caption and every image embeds to nearly the same vector (pairwise cosine ~0.9995);
      dropout noise on the text side then outweighs the image signal, the contrastive loss is
      lowest with all image embeddings equal, and the image tower collapses: text-image
      retrieval stays at chance however long it trains.
    * `vision_position_scale` multiplies the vision tower's initial position embeddings (std
      hidden_size ** -0.5, 0.125 for the tiny model) -- use 10. With CLIP's normalisation a
      patch of blank paper embeds to a vector of RMS ~2, so positions are drowned out and the
      vision tower learns *where* things are (the caption's left/middle/right) very slowly.
    """
    _check_dropout(dropout)
    if (
        isinstance(vision_position_scale, bool)
        or not isinstance(vision_position_scale, (int, float))
        or not vision_position_scale > 0
    ):
        raise ValueError(f"vision_position_scale must be a positive number, got {vision_position_scale!r}")
    import torch
    from transformers import BridgeTowerForContrastiveLearning

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(default_tokenizer_corpus(seed) if corpus is None else corpus, out)
    config = bridgetower_config(
        large=large,
        vocab_size=50265 if large else len(tokenizer),
        image_size=image_size,
        patch_size=patch_size,
        layers=layers,
        dropout=dropout,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BridgeTowerForContrastiveLearning(config)
    if vision_position_scale != 1:
        with torch.no_grad():
            model.bridgetower.vision_model.visual.embeddings.position_embedding.weight.mul_(vision_position_scale)
    # The published model's files: its weights a pickled state dict (transformers 5 saves safetensors only)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(out))
    torch.save(model.state_dict(), out / MODEL_WEIGHTS)
    _save_image_processor(out, image_size)
    return out


def make_gaudi_config(out_dir) -> Path:
    """Write ``gaudi_config.json`` equal to Habana/clip's, for ``GaudiConfig.from_pretrained(out_dir)``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gaudi_config.json").write_text(json.dumps(HABANA_CLIP_GAUDI_CONFIG, indent=2) + "\n", encoding="utf-8")
    return out


# ---------------------------------------------------------------------------------------------
# Building fixtures once, atomically
# ---------------------------------------------------------------------------------------------


def default_fixtures_root() -> Path:
    """$BRIDGETOWER_BENCH_FIXTURES, else `<repo>/.cache/fixtures` (git-ignored)."""
    configured = os.environ.get(FIXTURES_ENV)
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[2] / ".cache" / "fixtures"


def is_complete(fixture_dir, params: dict) -> bool:
    """True when `fixture_dir` was fully built with exactly `params` (its marker file says so)."""
    marker = Path(fixture_dir) / MARKER_FILE
    try:
        return json.loads(marker.read_text(encoding="utf-8")) == params
    except (OSError, ValueError):
        return False


def build_once(final_dir, params: dict, build: Callable[[Path], object]) -> bool:
    """Make `final_dir` a complete fixture built with `params`; return False if it already was.

    `build(tmp_dir)` runs in a fresh temporary sibling (`<name>.partial-<host>-<pid>.<random>`) that
    is marked complete and then renamed to `final_dir`, replacing an incomplete or differently built
    one. A killed build leaves only the temporary directory, which is never taken for a fixture.
    Builds are deterministic, so when a concurrent process finishes the same fixture first, ours is
    simply dropped.
    """
    final_dir = Path(final_dir)
    if is_complete(final_dir, params):
        return False
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(final_dir, keep_existing=lambda: is_complete(final_dir, params)) as tmp:
        build(Path(tmp))
        (Path(tmp) / MARKER_FILE).write_text(json.dumps(params), encoding="utf-8")
    return True


# Bump when a generator's output changes, so that cached fixtures are rebuilt.
FIXTURES_VERSION = 3
# The default model (local preset and most tests) sees BridgeTower's 294-px images, so the image
# pipelines do exactly the work they do for BridgeTower Large, but through 42-px patches (7 x 7) and one
# layer per tower: one training step then costs a few ms per sample on one CPU core, less than upstream's
# image loading (about 10 ms per image per core). The local preset is thereby loader-bound like the
# published accelerator runs (on the H100s, upstream lost 44 % of its speed at workers=0), rather than
# bound by a CPU forward pass, and the loader settings it sweeps show on the CPU.
DEFAULT_MODEL_OPTIONS = {"seed": 0, "image_size": 294, "patch_size": 42, "layers": 1, "large": False}
DEFAULT_DATASET_OPTIONS = {"train_rows": 192, "validation_rows": 48, "test_rows": 48, "rows_per_cartoon": 4, "seed": 0}


def fixture_params(kind: str, **options) -> dict:
    """What a fixture's marker file records: its kind, the generator version and its options."""
    return {"kind": kind, "version": FIXTURES_VERSION, **options}


def fixture_dir(root, kind: str, **options) -> Path:
    """Where `build_fixture(root, kind, **options)` puts the fixture."""
    if kind == "model":
        return Path(root) / (LARGE_MODEL_DIR_NAME if options.get("large") else MODEL_DIR_NAME)
    names = {"dataset": DATASET_DIR_NAME, "gaudi_config": GAUDI_CONFIG_DIR_NAME}
    if kind not in names:
        raise ValueError(f"unknown fixture kind {kind!r}; expected model, dataset or gaudi_config")
    return Path(root) / names[kind]


def build_fixture(root, kind: str, **options) -> Path:
    """Build fixture `kind` ("model", "dataset", "gaudi_config") with `options` under `root`,
    unless it is already there complete; return its directory."""
    builders = {"model": make_tiny_model, "dataset": make_synthetic_dataset, "gaudi_config": make_gaudi_config}
    final_dir = fixture_dir(root, kind, **options)
    build_once(final_dir, fixture_params(kind, **options), lambda tmp: builders[kind](tmp, **options))
    return final_dir


def ensure_default_fixtures(root=None) -> dict[str, Path]:
    """Build the default tiny model, synthetic data set and Gaudi config under `root` (default:
    `default_fixtures_root()`) unless they are already there complete; return their directories
    under the keys "model", "dataset" and "gaudi_config"."""
    root = Path(root) if root is not None else default_fixtures_root()
    root.mkdir(parents=True, exist_ok=True)
    remove_abandoned(root, min_age_s=600)  # builds killed on this host, at least ten minutes ago
    return {
        "model": build_fixture(root, "model", **DEFAULT_MODEL_OPTIONS),
        "dataset": build_fixture(root, "dataset", **DEFAULT_DATASET_OPTIONS),
        "gaudi_config": build_fixture(root, "gaudi_config"),
    }


def script_arguments(paths: Mapping, **overrides) -> dict[str, str]:
    """A script run on fixtures (`paths`: "model" and "dataset" directories, as `ensure_default_fixtures`
    gives them): the model, data set, configuration and columns, by argument name, as the published run
    names them; `overrides` set an argument, or with None leave it out. The fixtures' command line, one home
    for the tools and the tests."""
    arguments = {
        "model_name_or_path": paths["model"],
        "dataset_name": paths["dataset"],
        "dataset_config_name": DATASET_CONFIG_NAME,
        "image_column": published.IMAGE_COLUMN,
        "caption_column": published.CAPTION_COLUMN,
        **overrides,
    }
    return {name: str(value) for name, value in arguments.items() if value is not None}


def script_flags(paths: Mapping, **overrides) -> list[str]:
    """`script_arguments` as a script's command-line words."""
    return [word for name, value in script_arguments(paths, **overrides).items() for word in (f"--{name}", value)]


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bridgetower_bench.tools.fixtures",
        description="Write offline fixtures: random-weight BridgeTower model, synthetic New Yorker "
        "`matching` data set, Habana/clip Gaudi config.",
    )
    parser.add_argument("what", nargs="?", default="all", choices=("model", "dataset", "gaudi-config", "all"))
    parser.add_argument(
        "--out", type=Path, default=None, help=f"output root (default: ${FIXTURES_ENV} or <repo>/.cache/fixtures)"
    )
    parser.add_argument("--large", action="store_true", help="BridgeTower Large shape (~866 M parameters)")
    parser.add_argument("--image-size", type=int, default=294)
    parser.add_argument(
        "--patch-size",
        type=int,
        default=None,
        help=f"vision patch side (default: {DEFAULT_MODEL_OPTIONS['patch_size']}; 14 with --large)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"tiny model's layers per tower (default: {DEFAULT_MODEL_OPTIONS['layers']})",
    )
    parser.add_argument("--train-rows", type=int, default=192)
    parser.add_argument("--validation-rows", type=int, default=48)
    parser.add_argument("--test-rows", type=int, default=48)
    parser.add_argument("--rows-per-cartoon", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--exif-rotated-every",
        type=int,
        default=0,
        metavar="N",
        help="store every Nth cartoon transposed, with the EXIF orientation tag that turns it "
        "upright (orientations 2-8 in turn), as phone photos and scans may be (default 0: none)",
    )
    args = parser.parse_args(argv)
    if args.large and args.layers is not None:
        parser.error("--layers sets the tiny model's depth; BridgeTower Large's (--large) is fixed")
    for flag in (
        "image_size",
        "patch_size",
        "layers",
        "train_rows",
        "validation_rows",
        "test_rows",
        "rows_per_cartoon",
    ):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if args.exif_rotated_every < 0:
        parser.error(f"--exif-rotated-every must be 0 or a positive integer, got {args.exif_rotated_every}")
    return args


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.out is not None:
        tool_paths.output_dir("--out", args.out)
    root = args.out if args.out is not None else default_fixtures_root()
    requested = {
        "model": _model_options(args),
        "dataset": {
            "train_rows": args.train_rows,
            "validation_rows": args.validation_rows,
            "test_rows": args.test_rows,
            "rows_per_cartoon": args.rows_per_cartoon,
            "seed": args.seed,
            # only when asked for, so that the default data set's recorded options stay as they were
            **({"exif_rotated_every": args.exif_rotated_every} if args.exif_rotated_every else {}),
        },
        "gaudi_config": {},
    }
    if args.what != "all":
        requested = {args.what.replace("-", "_"): requested[args.what.replace("-", "_")]}
    for kind, options in requested.items():
        started = time.perf_counter()
        reused = is_complete(fixture_dir(root, kind, **options), fixture_params(kind, **options))
        path = build_fixture(root, kind, **options)
        how = "already complete" if reused else f"built in {time.perf_counter() - started:.1f} s"
        print(f"{kind + ':':13} {path}  ({how})")
        print(_summary(kind, path))


def _model_options(args: argparse.Namespace) -> dict:
    """The model fixture's options from the command line: DEFAULT_MODEL_OPTIONS unless told otherwise."""
    if args.large:
        options = {"seed": args.seed, "image_size": args.image_size, "large": True}
        if args.patch_size is not None:
            options["patch_size"] = args.patch_size
        return options
    return {
        **DEFAULT_MODEL_OPTIONS,
        "seed": args.seed,
        "image_size": args.image_size,
        "patch_size": args.patch_size or DEFAULT_MODEL_OPTIONS["patch_size"],
        "layers": args.layers or DEFAULT_MODEL_OPTIONS["layers"],
    }


def _summary(kind: str, path: Path) -> str:
    """One line on what a fixture holds: parameter count, image spread, or the config itself."""
    if kind == "model":
        from transformers import BridgeTowerConfig

        config = BridgeTowerConfig.from_pretrained(path)
        n_params = parameter_count(config)
        size_mib = sum(f.stat().st_size for f in path.iterdir()) / 2**20
        vision = config.vision_config
        return (
            f"  {n_params:,} parameters ({n_params / 1e6:.1f} M), hidden {config.hidden_size}, layers "
            f"{config.text_config.num_hidden_layers}/{vision.num_hidden_layers}/{config.num_hidden_layers} "
            f"(text/vision/cross-modal), text vocabulary {config.text_config.vocab_size}, image_size "
            f"{vision.image_size}, patch {vision.patch_size}, {size_mib:.1f} MiB"
        )
    if kind == "dataset":
        spread = image_spread(path)
        kb_min, kb_median, kb_max = spread["jpeg_kb"]
        rows = json.loads((path / MARKER_FILE).read_text())
        return (
            f"  rows train/validation/test {rows['train_rows']}/{rows['validation_rows']}/{rows['test_rows']}, "
            f"{spread['images']} cartoons: width {spread['width'][0]}-{spread['width'][1]} px, height "
            f"{spread['height'][0]}-{spread['height'][1]} px, {spread['portrait']} portrait, "
            f"JPEG {kb_min:.0f}/{kb_median:.0f}/{kb_max:.0f} KB (min/median/max)"
        )
    return f"  gaudi_config.json: {json.dumps(json.loads((path / 'gaudi_config.json').read_text()))}"


if __name__ == "__main__":
    tool_paths.run(main)
