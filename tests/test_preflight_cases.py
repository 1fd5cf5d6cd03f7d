"""Preflight in the cases a data set really has: one bad picture shown in many rows, files of the same name in
different folders, cells holding no image at all, and more distinct images than one decode round."""

import datasets
import pytest

from bridgetower_bench import preflight
from test_reliability import embedded, jpeg_bytes

GOOD, OTHER = jpeg_bytes(0), jpeg_bytes(1)
TRUNCATED = GOOD[: len(GOOD) // 2]


def image_rows(problems):
    return [(p.split, p.row) for p in problems if p.column == "image"]


def test_a_bad_image_shown_in_several_rows_is_reported_and_dropped_in_every_row(tmp_path):
    images = [TRUNCATED, GOOD, TRUNCATED, OTHER, TRUNCATED, GOOD]
    (tmp_path / "good.jpg").write_bytes(GOOD)
    gone = str(tmp_path / "gone.jpg")
    paths = [gone, str(tmp_path / "good.jpg"), gone, gone]
    splits = {
        "train": embedded(images, [f"train {i}" for i in range(len(images))]),
        "validation": datasets.Dataset.from_dict({"image": paths, "caption": [f"val {i}" for i in range(len(paths))]}),
    }
    problems, _ = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert image_rows(problems) == [("train", 0), ("train", 2), ("train", 4), ("validation", 0), ("validation", 2),
                                    ("validation", 3)]
    assert all(p.reason == f"missing image file {gone!r}" for p in problems if p.split == "validation")

    with pytest.raises(ValueError, match=r"^6 bad rows found before training"):
        preflight.check_splits(splits, "image", "caption", cache_dir=tmp_path / "cache")
    kept = preflight.check_splits(splits, "image", "caption", drop_bad_rows=True, cache_dir=tmp_path / "cache")
    assert list(kept["train"]["caption"]) == ["train 1", "train 3", "train 5"]
    assert list(kept["validation"]["caption"]) == ["val 1"]


@pytest.mark.parametrize("bad_first", [True, False])
def test_files_of_the_same_name_in_different_folders_get_their_own_verdict(tmp_path, bad_first):
    for folder, data in (("a", GOOD), ("b", TRUNCATED)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "cartoon.jpg").write_bytes(data)
    good, bad = str(tmp_path / "a" / "cartoon.jpg"), str(tmp_path / "b" / "cartoon.jpg")
    paths = [bad, good, bad, good] if bad_first else [good, bad, good, bad]
    splits = {"train": datasets.Dataset.from_dict({"image": paths, "caption": ["c"] * 4})}
    problems, cache_file = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert image_rows(problems) == ([("train", 0), ("train", 2)] if bad_first else [("train", 1), ("train", 3)])
    assert all(repr(bad) in p.reason for p in problems)

    # The cached outcome watches both files: replacing the good one with a broken one is noticed.
    (tmp_path / "a" / "cartoon.jpg").write_bytes(b"not a picture any more")
    again, _ = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert image_rows(again) == [("train", 0), ("train", 1), ("train", 2), ("train", 3)]


def test_cells_with_neither_bytes_nor_a_path_are_bad_rows(tmp_path):
    # As a parquet file's image struct holds them (no Image feature), and as an Image column holds an empty cell.
    struct = datasets.Features({"image": {"bytes": datasets.Value("binary"), "path": datasets.Value("string")},
                                "caption": datasets.Value("string")})
    cells = [{"bytes": GOOD, "path": None}, {"bytes": None, "path": None}, {"bytes": b"", "path": ""},
             {"bytes": None, "path": None}, {"bytes": OTHER, "path": None}]
    structs = datasets.Dataset.from_dict({"image": cells, "caption": ["c"] * len(cells)}, features=struct)
    image_feature = datasets.Features({"image": datasets.Image(decode=False), "caption": datasets.Value("string")})
    empty_cells = datasets.Dataset.from_dict({"image": [None, {"bytes": GOOD, "path": None}, None], "caption": ["c"] * 3},
                                             features=image_feature)
    (tmp_path / "ok.jpg").write_bytes(GOOD)
    path_cells = datasets.Dataset.from_dict({"image": [None, str(tmp_path / "ok.jpg"), ""], "caption": ["c"] * 3})
    splits = {"train": structs, "validation": empty_cells, "test": path_cells}
    problems, _ = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert image_rows(problems) == [("train", 1), ("train", 2), ("train", 3), ("validation", 0), ("validation", 2),
                                    ("test", 0), ("test", 2)]
    assert {p.reason for p in problems} == {"no image (empty cell: neither embedded bytes nor a path)"}
    kept = preflight.check_splits(splits, "image", "caption", drop_bad_rows=True, cache_dir=tmp_path / "cache")
    assert [len(kept[split]) for split in splits] == [2, 1, 1]


@pytest.mark.parametrize("num_proc", [1, 2])
def test_more_distinct_images_than_one_decode_round(tmp_path, monkeypatch, num_proc):
    """Rounds of 3 distinct images: bad ones in the first, a middle and the last (partial) round, and a bad
    image seen again after its round was decoded; every image is decoded once and every bad row named."""
    monkeypatch.setattr(preflight, "_IMAGES_PER_ROUND", 3)
    pictures = [jpeg_bytes(10 + i, size=(64, 48)) for i in range(11)]
    for i in (1, 5, 10):
        pictures[i] = pictures[i][: len(pictures[i]) * 3 // 4]
    assert len(set(pictures)) == 11
    images = pictures + [pictures[1], pictures[0]]  # rows 11 and 12 repeat images of the first round
    splits = {"train": embedded(images, [f"c{i}" for i in range(len(images))])}
    decoded = []
    if num_proc == 1:
        original = preflight.image_problem
        monkeypatch.setattr(preflight, "image_problem", lambda payload, **budget: decoded.append(payload) or original(payload, **budget))
    problems, cache_file = preflight.find_problems(splits, "image", "caption", num_proc=num_proc, cache_dir=tmp_path)
    assert image_rows(problems) == [("train", 1), ("train", 5), ("train", 10), ("train", 11)]
    assert all(p.reason.startswith("cannot decode embedded image") for p in problems)
    if num_proc == 1:
        assert sorted(decoded) == sorted(pictures), "each distinct image decoded exactly once"
