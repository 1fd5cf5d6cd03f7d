"""Protective checks in their other forms: the Gaudi-only flag guard's other spellings, and the decoded-image
cache's key (a cache is never reused for other library versions, another image mode or other pixels)."""

import dataclasses
import json

import numpy as np
import PIL
import pytest
from PIL import Image

from bridgetower_bench.arguments import WarmupTrainingArguments
from bridgetower_bench.guards import flag_guard
from bridgetower_bench.images import image_cache
from helpers import encode, optimum_habana, run_cuda_script, script_module


SCRIPT = "run_bridgetower_cuda.py"


def refusal(flags: str, verb: str = "is") -> str:
    pronoun = "it" if verb == "is" else "them"
    return (
        f"{SCRIPT}: error: {flags} {verb} Gaudi-only (Habana HPU) and not supported by {SCRIPT}; "
        f"remove {pronoun}, or run run_bridgetower.py on a Gaudi machine."
    )


# The flag guard: --flag=value, dashes, and the .json configuration form -------------------------------------------


def spellings(tmp_path, model):
    """name -> (argv after the script, the one stderr line expected)."""
    common = ["--model_name_or_path", model, "--train_file", tmp_path / "train.csv", "--output_dir", tmp_path / "out"]
    common += ["--do_train", "--report_to", "none", "--use_cpu"]
    config = tmp_path / "published.json"
    published = {"model_name_or_path": str(model), "output_dir": str(tmp_path / "out"), "do_train": True}
    config.write_text(json.dumps({**published, "gaudi_config_name": "Habana/clip", "use_habana": True}))
    dashed_config = tmp_path / "dashed.json"
    dashed_config.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "use-hpu-graphs-for-training": True}))
    return {
        "--flag=value": ([*common, "--use_habana=True"], refusal("--use_habana")),
        "--flag=False": ([*common, "--use_lazy_mode=False"], refusal("--use_lazy_mode")),
        "dashes": ([*common, "--use-habana"], refusal("--use_habana")),
        "dashes with =value": (
            [*common, "--gaudi-config-name=Habana/clip", "--sdp-on-bf16"],
            refusal("--gaudi_config_name, --sdp_on_bf16", "are"),
        ),
        "json configuration": ([config], refusal("--gaudi_config_name, --use_habana", "are")),
        "json configuration with dashes": ([dashed_config], refusal("--use_hpu_graphs_for_training")),
        # once transformers' "not used by the HfArgumentParser" line, as every GaudiTrainingArguments field outside
        # the list
        "a Gaudi trainer's flag": ([*common, "--pipelining_fwd_bwd"], refusal("--pipelining_fwd_bwd")),
    }


ON_THE_COMMAND_LINE = ["--flag=value", "--flag=False", "dashes", "dashes with =value", "a Gaudi trainer's flag"]


@pytest.mark.parametrize("case", [*ON_THE_COMMAND_LINE, "json configuration", "json configuration with dashes"])
def test_every_spelling_of_a_gaudi_only_flag_is_refused_in_one_line(case, fixtures, tmp_path):
    args, expected = spellings(tmp_path, fixtures["model"])[case]
    status, stderr = run_cuda_script(args)
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == expected
    assert not (tmp_path / "out").exists()


def test_the_guard_names_flags_only_not_values_or_lookalikes(tmp_path):
    # Values, lookalike names and single-dash words are not Gaudi flags.
    argv = [SCRIPT, "--output_dir", "use_habana", "--use_habana_extra", "x", "-use_habana", "--mediapipe_dataloader_x"]
    assert flag_guard.hpu_only_flags_in([*argv, "--use_cpu", "--use_habana"]) == ["--use_habana"]
    assert flag_guard.hpu_only_flags_in([SCRIPT, "--output_dir", "out", "--do_train"]) == []
    assert flag_guard.hpu_only_flags_in([SCRIPT, "--use_habana"]) == ["--use_habana"]  # one flag is not a file
    # A .json file among other flags is not a configuration file: only its flags count.
    assert flag_guard.hpu_only_flags_in([SCRIPT, "config.json", "--sdp_on_bf16=True"]) == ["--sdp_on_bf16"]
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"mediapipe_dataloader": True, "distribution_strategy": "fast_ddp", "seed": 1}))
    assert flag_guard.hpu_only_flags_in([SCRIPT, str(config)]) == ["--distribution_strategy", "--mediapipe_dataloader"]


def test_the_gaudi_only_flags_are_the_gaudi_trainers_arguments_the_cuda_script_lacks():
    cuda = script_module("cuda")
    with optimum_habana() as habana:
        gaudi = {f.name for f in dataclasses.fields(habana.GaudiTrainingArguments) if f.init}
    ours = {f.name for cls in (cuda.DataTrainingArguments, WarmupTrainingArguments) for f in dataclasses.fields(cls)}
    assert sorted(gaudi - ours - set(flag_guard.HPU_ONLY_FLAGS)) == [], "add them to flag_guard.HPU_ONLY_FLAGS"
    assert sorted(set(flag_guard.HPU_ONLY_FLAGS) - gaudi - {"mediapipe_dataloader"}) == [], "no longer Gaudi's"


# The decoded-image cache key ------------------------------------------------------------------------------------


def test_a_cache_or_manifest_built_with_another_pillow_is_never_reused(tmp_path, monkeypatch):
    """Pillow's resampling and JPEG decoding change between versions: the cache directory changes with it."""
    for pipeline in image_cache.CACHEABLE_PIPELINES:
        before = image_cache.decoded_image_cache_dir(tmp_path, pipeline, 294, "fingerprint")
        assert image_cache.decoded_image_cache_dir(tmp_path, pipeline, 294, "fingerprint") == before  # stable
        monkeypatch.setattr(PIL, "__version__", PIL.__version__ + ".post1")
        assert image_cache.decoded_image_cache_dir(tmp_path, pipeline, 294, "fingerprint") != before
        assert image_cache.cache_settings(pipeline, 294, "fingerprint")["pillow"] == PIL.__version__
        monkeypatch.undo()
    # nor is a manifest from another Pillow read as complete
    values = [{"bytes": encode(Image.new("RGB", (40, 30), (200, 10, 10)), "PNG"), "path": None}]
    cache = image_cache.open_decoded_image_cache(
        values, pipeline="fast", image_size=32, cache_dir=tmp_path, fingerprint="f"
    )
    settings = image_cache.cache_settings("fast", 32, "f")
    assert image_cache.read_complete_manifest(cache.directory, settings) is not None
    monkeypatch.setattr(PIL, "__version__", PIL.__version__ + ".post1")
    assert image_cache.read_complete_manifest(cache.directory, image_cache.cache_settings("fast", 32, "f")) is None


def test_a_pil_images_mode_and_pixels_are_part_of_its_identity():
    grey = Image.new("L", (8, 6), 7)
    palette = Image.new("P", (8, 6), 7)  # the same bytes in memory, another picture once converted to RGB
    assert grey.tobytes() == palette.tobytes()
    assert image_cache.image_digest(grey) != image_cache.image_digest(palette)

    pixels = np.full((6, 8, 3), 100, dtype=np.uint8)
    one = Image.fromarray(pixels)
    pixels[5, 7, 2] = 101  # one channel of one pixel
    other = Image.fromarray(pixels)
    assert image_cache.image_digest(one) != image_cache.image_digest(other)
    same = Image.fromarray(np.full((6, 8, 3), 100, np.uint8))
    assert image_cache.image_digest(one) == image_cache.image_digest(same)

    # Same bytes, other shape: 8x6 vs 6x8.
    assert image_cache.image_digest(Image.new("L", (6, 8), 7)) != image_cache.image_digest(grey)
