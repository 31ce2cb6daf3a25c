"""Image folders and CIFAR pickles as people actually have them, prepared and read back.

Each test lays out real JPEG/PNG files (or pickles), runs the prepare step the way a user does,
then reads the shards back with webdataset's own grouping and the repository's eval loader:
every file must come out once, in its split, under the key and label of its class folder.
"""
import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tarfile
import unicodedata
from collections import Counter

import numpy as np
import pytest
from webdataset.tariterators import group_by_keys, tar_file_iterator

from conftest import run_launcher
from pretrain.data import synthetic
from pretrain.data.eval_loader import EvalLoader
from pretrain.data.info import read_info
from pretrain.data.shards import ShardSet
from pretrain.data.samples import decode_label, image_bytes
from pretrain.data.shard_writer import prepare
from pretrain.data.sources import PrepareError

LAYOUT = "expected <root>/<class>/<image> or <root>/{train,val,test}/<class>/<image>"


def write_images(root, files):
    """Real images at ``root/<path>`` (a str, or bytes for a name that is not UTF-8), PNG where
    the name ends in .png in any case; each file its own width, so a sample shows which file it is.
    Returns {path: width}."""
    rng = np.random.default_rng(0)
    widths = {}
    for i, rel in enumerate(files):
        path = os.path.join(os.fsencode(root), rel if isinstance(rel, bytes) else os.fsencode(rel))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fmt = "PNG" if path.lower().endswith(b".png") else "JPEG"
        widths[rel] = 12 + i
        with open(path, "wb") as f:
            f.write(synthetic.class_image(i % 3, 3, rng, (widths[rel], 10), fmt))
    return widths


def read_back(out):
    """(info, {split: {key: json meta}}), after checking every sample the way training reads it."""
    info = read_info(out)
    splits = {}
    for split in info.splits:
        shards = ShardSet.from_info(str(out), split)
        samples = {}
        for url in shards.urls:
            with tarfile.open(url) as tar:  # lower-case fields after the key's only dot
                assert all(m.name.count(".") == 1 and m.name.endswith((".jpg", ".cls", ".json"))
                           for m in tar), tar.getnames()
            with open(url, "rb") as f:
                members = ({**m, "__url__": url} for m in tar_file_iterator(f))
                for s in group_by_keys(members):
                    assert set(s) == {"__key__", "__url__", "jpg", "cls", "json"}, s.keys()
                    meta = json.loads(s["json"])
                    assert image_bytes(s) == s["jpg"]
                    assert decode_label(s, len(info.classes)) == meta["label"]
                    assert info.classes[meta["label"]] == meta["class_name"]
                    assert s["__key__"] not in samples
                    samples[s["__key__"]] = meta
        assert len(samples) == shards.num_samples
        # The eval loader decodes every image; one it could not read would come back as padding.
        loader = EvalLoader(shards, img_size=16, batch_size=8, num_classes=len(info.classes))
        seen = {k: label for b in loader for k, label in zip(b.keys, b.labels.tolist()) if k}
        assert seen == {k: m["label"] for k, m in samples.items()}
        splits[split] = samples
    return info, splits


def assert_shards_hold(out, widths, expected):
    """``expected``: {split: {key: (class name, file path)}}; each file under its key and class."""
    info, splits = read_back(out)
    assert splits.keys() == expected.keys()
    for split, samples in splits.items():
        assert {k: m["class_name"] for k, m in samples.items()} == \
            {k: c for k, (c, _) in expected[split].items()}
        assert {k: m["width"] for k, m in samples.items()} == \
            {k: widths[path] for k, (_, path) in expected[split].items()}
    assert {n: s.num_samples for n, s in info.splits.items()} == {s: len(e) for s, e in expected.items()}
    return info


def test_splits_numbered_afresh_and_same_name_in_two_classes(tmp_path):
    """What exported datasets look like: 0001.png in every class folder of every split."""
    files = [f"{split}/{cls}/{n:04d}.png" for split, count in (("train", 3), ("val", 2))
             for cls in ("cat", "dog") for n in range(1, count + 1)]
    widths = write_images(tmp_path / "raw", files)
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(tmp_path / "raw"),
                        "--out", str(tmp_path / "out"), "--shard-size", "4", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    expected = {"train": {}, "validation": {}}
    for path in files:
        split, cls, name = path.split("/")
        expected["train" if split == "train" else "validation"][f"{cls}/{name[:-4]}"] = (cls, path)
    info = assert_shards_hold(tmp_path / "out", widths, expected)
    assert info.classes == ["cat", "dog"]
    assert "6 train in 2 shards, 4 validation in 1 shards" in proc.stderr


def test_same_stem_with_two_extensions_keeps_them_apart(tmp_path):
    # b.v1 and b_v1 are one key once the dot is replaced, so they keep their extensions too.
    files = ["cat/0001.jpg", "dog/0001.jpg", "cat/a.jpg", "cat/a.PNG", "dog/b.v1.jpg", "dog/b_v1.png"]
    widths = write_images(tmp_path / "raw", files)
    prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"), shard_size=4, progress=False)
    keys = ["cat/0001", "dog/0001", "cat/a_jpg", "cat/a_PNG", "dog/b_v1_jpg", "dog/b_v1_png"]
    expected = {"train": {k: (p.split("/")[0], p) for k, p in zip(keys, files)}}
    assert_shards_hold(tmp_path / "out", widths, expected)


def test_a_true_key_clash_within_a_split_names_both_files(tmp_path):
    # A dot becomes "_" in keys (webdataset cuts the extension at the first dot), so these clash.
    write_images(tmp_path / "raw", ["train/cat/img.v2.jpg", "train/cat/img_v2.jpg", "val/cat/x.jpg"])
    with pytest.raises(PrepareError) as e:
        prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"), progress=False)
    message = str(e.value)
    assert "\n" not in message
    assert str(tmp_path / "raw" / "train" / "cat" / "img.v2.jpg") in message
    assert str(tmp_path / "raw" / "train" / "cat" / "img_v2.jpg") in message
    assert "split 'train'" in message and message.endswith("rename one of them")


def test_odd_file_and_folder_names(tmp_path):
    nfd_cafe = unicodedata.normalize("NFD", "café")  # how macOS spells the folder
    assert nfd_cafe != "café"
    files = {
        "train/cat/img.v2.final.jpg": ("cat", "cat/img_v2_final"),
        "train/cat/my photo (1).JPG": ("cat", "cat/my photo (1)"),
        "train/cat/café_ü.jpg": ("cat", "cat/café_ü"),
        b"train/cat/caf\xe9 latin-1.jpg": ("cat", "cat/caf\ufffd latin-1"),
        "train/猫/猫.png": ("猫", "猫/猫"),
        "train/猫/UPPER.JPEG": ("猫", "猫/UPPER"),
        "train/猫/loud.PNG": ("猫", "猫/loud"),
        "train/café/x.Jpg": ("café", "café/x"),
        f"val/{nfd_cafe}/y.jpeg": ("café", "café/y"),
        "val/cat/z.JPG": ("cat", "cat/z"),
        # webdataset drops members under a "__name__/" folder as its metadata
        "train/__misc__/m.jpg": ("__misc__", "_misc__/m"),
    }
    widths = write_images(tmp_path / "raw", list(files))
    prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"), shard_size=4, progress=False)
    expected = {"train": {}, "validation": {}}
    for path, (cls, key) in files.items():
        split = "train" if (path if isinstance(path, bytes) else path.encode()).startswith(b"train") \
            else "validation"
        expected[split][key] = (cls, path)
    info = assert_shards_hold(tmp_path / "out", widths, expected)
    assert info.classes == ["__misc__", "café", "cat", "猫"]


def test_two_class_folders_whose_names_read_the_same_are_refused(tmp_path):
    """café in Latin-1 and cafè in Latin-1 both read as 'caf\ufffd': they were one class."""
    write_images(tmp_path / "raw", [b"caf\xe9/0.jpg", b"caf\xe8/1.jpg", "dog/2.jpg"])
    with pytest.raises(PrepareError) as e:
        prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"), progress=False)
    assert str(e.value) == (f"the class folders b'caf\\xe8' and b'caf\\xe9' in {tmp_path / 'raw'} "
                            f"both read as class 'caf\ufffd'; rename one of them")


def test_editor_and_macos_leftovers_are_not_classes_or_images(tmp_path):
    files = ["cat/a.jpg", "dog/b.jpg", "__MACOSX/cat/a.jpg", ".ipynb_checkpoints/c.jpg",
             "cat/.hidden/d.jpg"]
    widths = write_images(tmp_path / "raw", files)
    (tmp_path / "raw" / "cat" / "._a.jpg").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (tmp_path / "raw" / "dog" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    info = prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"), progress=False)
    assert info.classes == ["cat", "dog"]
    assert info.extra["num_skipped"] == 0
    assert_shards_hold(tmp_path / "out", widths, {"train": {"cat/a": ("cat", "cat/a.jpg"),
                                                            "dog/b": ("dog", "dog/b.jpg")}})


def test_nested_class_folders_are_refused_with_the_expected_layout(tmp_path):
    write_images(tmp_path / "raw", ["train/animals/cat/x.jpg", "train/animals/dog/y.jpg",
                                    "train/plants/fern/z.jpg", "val/animals/cat/w.jpg"])
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(tmp_path / "raw"),
                        "--out", str(tmp_path / "out"), "--workers", "1")
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: found images two levels down in {tmp_path / 'raw' / 'train' / 'animals'}")
    assert LAYOUT in line and "point --src at the folder whose subfolders are the classes" in line
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "out").glob("*.tar"))


def test_train_valid_test_exports_give_three_splits_and_left_out_folders_are_named(tmp_path,
                                                                                    caplog):
    """Roboflow's layout (train/valid/test); an unlabelled flat test folder, as ImageNet and
    Kaggle ship it, and folders that are no split are left out with a word, not in silence."""
    files = [f"{split}/{cls}/{n}.jpg" for split in ("train", "valid", "test")
             for cls in ("cat", "dog") for n in range(2)]
    widths = write_images(tmp_path / "raw", files + ["extras/cat/x.jpg"])
    with caplog.at_level("WARNING", logger="pretrain.data.folders"):
        prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"), progress=False)
    assert f"left out the folders extras of {tmp_path / 'raw'}" in caplog.text
    names = {"train": "train", "valid": "validation", "test": "test"}
    expected = {split: {} for split in names.values()}
    for path in files:
        split, cls, name = path.split("/")
        expected[names[split]][f"{cls}/{name[:-4]}"] = (cls, path)
    assert_shards_hold(tmp_path / "out", widths, expected)

    caplog.clear()
    write_images(tmp_path / "kaggle", ["train/cat/a.jpg", "val/cat/b.jpg", "test/c.jpg"])
    with caplog.at_level("WARNING", logger="pretrain.data.folders"):
        info = prepare("imagefolder", str(tmp_path / "kaggle"), str(tmp_path / "out2"),
                       progress=False)
    assert set(info.splits) == {"train", "validation"}
    assert f"left out {tmp_path / 'kaggle' / 'test'}: no class folders in it" in caplog.text

    # split folders spelt in capitals (exports from Windows tools): the same splits
    caplog.clear()
    write_images(tmp_path / "caps", ["Train/cat/a.jpg", "Train/dog/b.jpg", "Val/cat/c.jpg",
                                     "TEST/d.jpg"])
    with caplog.at_level("WARNING", logger="pretrain.data.folders"):
        info = prepare("imagefolder", str(tmp_path / "caps"), str(tmp_path / "out3"),
                       progress=False)
    assert set(info.splits) == {"train", "validation"} and info.classes == ["cat", "dog"]
    assert (info.splits["train"].num_samples, info.splits["validation"].num_samples) == (2, 1)
    assert f"left out {tmp_path / 'caps' / 'TEST'}: no class folders in it" in caplog.text
    assert "left out the folders" not in caplog.text


def test_a_train_folder_alone_is_the_training_split_and_beside_classes_a_class(tmp_path):
    """An export of its training split only: train/<class>/<image>, nothing beside it. It was
    refused ("found images two levels down in .../train"); it prepares as its class folders
    would at the root, the validation split held out alike. A folder named train beside class
    folders stays a class (vehicles: bus, car, train)."""
    files = [f"{cls}/{n}.jpg" for cls in ("cat", "dog") for n in range(6)]
    write_images(tmp_path / "export" / "train", files)
    write_images(tmp_path / "flat", files)
    infos = [prepare("imagefolder", str(tmp_path / src), str(tmp_path / f"out-{src}"),
                     val_count=2, progress=False) for src in ("export", "flat")]
    assert infos[0].classes == infos[1].classes == ["cat", "dog"]
    assert {n: s.num_samples for n, s in infos[0].splits.items()} == \
        {n: s.num_samples for n, s in infos[1].splits.items()} == {"train": 10, "validation": 2}

    write_images(tmp_path / "vehicles", [f"{cls}/{n}.jpg" for cls in ("bus", "train")
                                         for n in range(3)])
    info = prepare("imagefolder", str(tmp_path / "vehicles"), str(tmp_path / "out-vehicles"),
                   val_count=2, progress=False)
    assert info.classes == ["bus", "train"]


def test_val_class_folders_without_a_training_folder_are_all_named_at_once(tmp_path):
    """Each was refused by a run of its own; a spelling that differs in case only is pointed
    out (exports from tools that capitalise)."""
    write_images(tmp_path / "raw", [*(f"train/{c}/{i}.jpg" for c in ("cat", "dog")
                                      for i in range(3)),
                                    *(f"val/{c}/0.jpg" for c in ("Cat", "dog", "horse"))])
    with pytest.raises(PrepareError) as e:
        prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"), progress=False)
    assert str(e.value) == (
        f"class folders 'Cat' (the class 'cat' in another case?), 'horse' in "
        f"{tmp_path / 'raw' / 'val'} are not known classes; every class of a val or test folder "
        f"needs a training folder of the same name")
    assert not list((tmp_path / "out").glob("*.tar"))


def test_files_that_are_no_images_and_classes_without_images_are_said(tmp_path, caplog):
    from PIL import Image
    widths = write_images(tmp_path / "raw", ["cat/a.jpg", "dog/b.jpg"])
    Image.new("RGB", (20, 10), (200, 30, 30)).save(tmp_path / "raw" / "dog" / "c.bmp")
    (tmp_path / "raw" / "cat" / "notes.txt").write_text("not a picture")
    (tmp_path / "raw" / "cat" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (tmp_path / "raw" / "fox").mkdir()
    (tmp_path / "raw" / "README.txt").write_text("beside the class folders")
    with caplog.at_level("WARNING", logger="pretrain.data.folders"):
        info = prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"),
                       progress=False)
    assert info.classes == ["cat", "dog", "fox"]  # the label of an empty class is kept
    assert info.num_labels == 3  # was 2 (the largest label used + 1): a head without fox
    assert "left out 2 files that are not images (by extension: .txt 2; e.g. " \
        "cat/notes.txt)" in caplog.text
    # (it was counted as a file that is no image, by its name a .jpg)
    assert "left out 1 links that lead nowhere (e.g. cat/gone.jpg): their targets moved or " \
        "are not mounted here" in caplog.text
    assert "1 class folders hold no images (fox)" in caplog.text
    widths["dog/c.bmp"] = 20  # a BMP is read and stored as JPEG
    assert_shards_hold(tmp_path / "out", widths, {"train": {
        "cat/a": ("cat", "cat/a.jpg"), "dog/b": ("dog", "dog/b.jpg"),
        "dog/c": ("dog", "dog/c.bmp")}})


def test_a_split_folder_without_images_is_said(tmp_path, caplog):
    """An empty val/ (its class folders made, the images not copied yet) gave a dataset with
    no validation split and not a word until a training run stopped on it."""
    write_images(tmp_path / "raw", [f"train/{c}/{i}.jpg" for c in ("cat", "dog") for i in range(2)])
    for c in ("cat", "dog"):
        (tmp_path / "raw" / "val" / c).mkdir(parents=True)
    with caplog.at_level("WARNING", logger="pretrain.data.folders"):
        info = prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"),
                       progress=False)
    assert list(info.splits) == ["train"]
    assert f"{tmp_path / 'raw' / 'val'} holds no images: the dataset gets no validation split " \
           f"(a training run evaluating it would stop at its start; data.val_split=null there)" \
        in caplog.text


def test_a_16_bit_grayscale_png_keeps_its_tones(tmp_path):
    """PIL's convert to RGB clips 16-bit values at 255: the image came out white."""
    from PIL import Image
    tones = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    (tmp_path / "raw" / "scan").mkdir(parents=True)
    Image.fromarray(tones).save(tmp_path / "raw" / "scan" / "x.png")
    assert Image.open(tmp_path / "raw" / "scan" / "x.png").mode == "I;16"
    prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"), progress=False)
    [url] = ShardSet.from_info(str(tmp_path / "out"), "train").urls
    with tarfile.open(url) as tar:
        jpg = tar.extractfile(next(m for m in tar if m.name.endswith(".jpg"))).read()
    stored = np.asarray(Image.open(io.BytesIO(jpg)).convert("L"), dtype=np.float64)
    assert abs(stored.mean() - (tones >> 8).mean()) < 3  # was 255 nearly everywhere


def test_a_phone_photo_is_stored_upright_and_a_large_scan_is_read(tmp_path):
    """A phone keeps a portrait photo as landscape pixels and an EXIF orientation, which the
    training decoders ignore: it trained sideways. A 180 M pixel scan was skipped as PIL's
    "decompression bomb"; an unreadable file's reason named an in-memory buffer; a float TIFF
    came out black."""
    from PIL import Image
    raw = tmp_path / "raw"
    (raw / "phone").mkdir(parents=True)
    pixels = np.zeros((30, 40, 3), np.uint8)
    pixels[:, :20] = 255  # stored: white on the left; shown (turned 90 degrees clockwise): on top
    for name, orientation in (("portrait.jpg", 6), ("upright.jpg", 1)):
        img = Image.fromarray(pixels)
        exif = img.getexif()
        exif[0x0112] = orientation
        img.save(raw / "phone" / name, exif=exif.tobytes(), quality=95)
    (raw / "scan").mkdir()
    Image.new("L", (15000, 12000), 128).save(raw / "scan" / "page.png")
    (raw / "scan" / "broken.png").write_bytes(b"not a png at all")
    Image.fromarray(np.full((8, 8), 0.5, np.float32)).save(raw / "scan" / "float.tif")
    prepare("imagefolder", str(raw), str(tmp_path / "out"), max_size=64, progress=False)
    info, splits = read_back(tmp_path / "out")
    meta = {k: (m["width"], m["height"]) for k, m in splits["train"].items()}
    assert meta == {"phone/portrait": (30, 40), "phone/upright": (40, 30),
                    "scan/page": (15000, 12000)}
    [url] = ShardSet.from_info(str(tmp_path / "out"), "train").urls
    with tarfile.open(url) as tar:
        shown = {m.name[:-4]: np.asarray(Image.open(io.BytesIO(tar.extractfile(m).read())))
                 for m in tar if m.name.endswith(".jpg")}
    portrait = shown["phone/portrait"]
    assert portrait.shape == (40, 30, 3)
    assert portrait[:15].mean() > 240 and portrait[-15:].mean() < 15  # white on top
    assert shown["scan/page"].shape == (64, 80, 3)
    # without --max-size it is stored within PIL's own limit, which the training loader keeps
    # (above twice it, the loader would skip it as undecodable); that limit is left as it was
    from pretrain.data.stored_image import to_jpeg
    jpg, width, height = to_jpeg((raw / "scan" / "page.png").read_bytes())
    assert (width, height) == (15000, 12000) and Image.MAX_IMAGE_PIXELS == 89_478_485
    with Image.open(io.BytesIO(jpg)) as stored:
        assert stored.size == (10575, 8460)
    skipped = json.loads((tmp_path / "out" / "_skipped.json").read_text())["skipped"]
    assert {s["key"]: s["error"] for s in skipped} == {
        "scan/broken": "UnidentifiedImageError: cannot identify image file",
        # (it came out black: PIL's convert clips values in [0, 1])
        "scan/float": "ValueError: floating-point pixels, whose range no file states: save "
                      "the image with 8 or 16 bits per channel"}


def test_an_output_folder_inside_the_source_is_refused(tmp_path):
    write_images(tmp_path / "raw", ["cat/a.jpg", "dog/b.jpg"])
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(tmp_path / "raw"),
                        "--out", str(tmp_path / "raw" / "shards"), "--workers", "1")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: the output folder {tmp_path / 'raw' / 'shards'} is inside --src "
        f"{tmp_path / 'raw'}; write it elsewhere")
    assert not (tmp_path / "raw" / "shards").exists()  # no phantom class for a next run
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(tmp_path / "raw"),
                        "--out", str(tmp_path / "out"), "--stage", str(tmp_path / "stage"))
    assert proc.returncode == 2 and "--stage is for a remote --out" in proc.stderr
    # an --out that cannot be made: a bad input, not "fix it and rerun to resume" (exit 1)
    (tmp_path / "notes").write_text("a file")
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(tmp_path / "raw"),
                        "--out", str(tmp_path / "notes" / "shards"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: cannot write {tmp_path / 'notes' / 'shards' / '.prepare'} (Not a directory); "
        f"choose an --out folder you can write to, in place of {tmp_path / 'notes' / 'shards'}"
    ), proc.stderr
    # ... and where a folder above it is the one that cannot be made (it was exit 1, "fix it
    # and rerun the same command to resume")
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(tmp_path / "raw"),
                        "--out", "/proc/vitscale-test/shards")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: cannot write /proc/vitscale-test (No such file or directory); choose an --out "
        "folder you can write to, in place of /proc/vitscale-test/shards"), proc.stderr


@pytest.mark.parametrize("files, where, problem", [
    (["cat/a.jpg", "cat/extra/b.jpg", "dog/c.jpg"], "cat", "found images two levels down in"),
    (["cat/a.jpg", "dog/c.jpg", "loose.PNG"], "", "found images directly in"),
    (["train/cat/a.jpg", "train/b.jpg", "val/cat/c.jpg"], "train", "found images directly in"),
    (["train/cat/a.jpg", "val/b.jpg"], "val", "found images directly in"),
], ids=["image-below-a-class-folder", "image-beside-the-class-folders", "image-in-the-train-folder",
        "a-flat-val-folder"])
def test_images_outside_the_class_folders_are_refused(tmp_path, files, where, problem):
    write_images(tmp_path / "raw", files)
    with pytest.raises(PrepareError) as e:
        prepare("imagefolder", str(tmp_path / "raw"), str(tmp_path / "out"), progress=False)
    message = str(e.value)
    assert "\n" not in message and LAYOUT in message
    assert message.startswith(f"{problem} {os.path.join(tmp_path / 'raw', where).rstrip(os.sep)}")
    # ImageNet-1k's flat val/ is another source's layout: named there, not elsewhere
    assert message.endswith("use the source imagenet1k") == (where == "val"), message


def resave_with_bytes_keys(path, names_key=None, protocol=pickle.DEFAULT_PROTOCOL):
    """What a Python 3 script writes back after loading a CIFAR file with encoding="bytes"."""
    with open(path, "rb") as f:
        obj = pickle.load(f)  # our own file: plain pickle is safe here
    if names_key:
        obj[names_key] = [n.encode() for n in obj[names_key]]
    with open(path, "wb") as f:
        pickle.dump({k.encode(): v for k, v in obj.items()}, f, protocol=protocol)


@pytest.mark.parametrize("resaved", ["meta", "all"])
@pytest.mark.parametrize("kind", ["cifar10", "cifar100"])
def test_cifar_with_bytes_keys(tmp_path, kind, resaved):
    raw = synthetic.write_cifar(tmp_path / "raw", kind, n_train=10, n_test=6)
    meta, names_key = ("batches.meta", "label_names") if kind == "cifar10" else ("meta", "fine_label_names")
    # Names that only decode right as UTF-8 show the bytes are not read as Latin-1.
    renamed = {raw.classes[0]: "café", raw.classes[-1]: "猫"}
    raw.classes = [renamed.get(c, c) for c in raw.classes]
    raw.samples = {k: (s, renamed.get(c, c)) for k, (s, c) in raw.samples.items()}
    with open(raw.root / meta, "wb") as f:
        pickle.dump({names_key: raw.classes}, f)
    for path in raw.root.iterdir():
        if path.name == meta:
            resave_with_bytes_keys(path, names_key)
        elif resaved == "all":  # numpy pickles arrays differently under protocol 5
            resave_with_bytes_keys(path, protocol=pickle.HIGHEST_PROTOCOL)
    prepare(kind, str(tmp_path / "raw"), str(tmp_path / "out"), shard_size=8, progress=False)
    info, splits = read_back(tmp_path / "out")
    assert info.classes == raw.classes
    assert {split: {k: m["class_name"] for k, m in samples.items()} for split, samples in splits.items()} \
        == {split: {k: c for k, (s, c) in raw.samples.items() if s == split} for split in ("train", "test")}
    assert Counter(s for s, _ in raw.samples.values()) == {"train": 10, "test": 6}


def shown_on_a_terminal(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: a carriage return goes back to the line's start,
    and what follows overwrites what was there."""
    shown = []
    for line in text.split("\n"):
        screen = ""
        for part in line.split("\r"):
            screen = part + screen[len(part):]
        shown.append(screen)
    return shown


def test_a_warning_during_the_index_pass_gets_its_own_line_above_the_bar(tmp_path):
    """The not-images warning used to be glued onto the "index:" progress bar's line. In a log
    file (stderr not a terminal, as here: a batch job's) each redraw of a bar is a line of its
    own; it was one line of carriage returns, growing for the hours of the pass."""
    write_images(tmp_path / "raw", ["cat/a.jpg", "dog/b.jpg"])
    (tmp_path / "raw" / "cat" / "notes.txt").write_text("not a picture")
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(tmp_path / "raw"),
                        "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = [line for line in shown_on_a_terminal(proc.stderr) if "not images" in line]
    assert len(warned) == 1 and warned[0].startswith("left out 1 files that are not images"), \
        proc.stderr
    assert "\r" not in proc.stderr
    assert re.search(r"^write: 100%\|#+\| 2/2 \[", proc.stderr, re.M), proc.stderr


# prepare() of an image folder, in one process, killed as it sets about its shard number AT
KILLED_WRITE = r'''
import os, signal, sys
from pretrain.data import shard_writer
src, out, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
write, calls = shard_writer.write_shard, []

def killed_at(job):
    calls.append(job)
    if len(calls) > at:
        os.kill(os.getpid(), signal.SIGKILL)
    return write(job)

shard_writer.write_shard = killed_at
shard_writer.prepare("imagefolder", src, out, shard_size=2, workers=1, progress=False)
'''


def test_a_source_changed_under_an_interrupted_run_is_listed_again_or_refused(tmp_path):
    """The listing of an interrupted run was reused whatever had become of the source: images
    added since were left out without a word, and each one removed failed every rerun. Now a
    changed source is listed again while no shard is written; after, it is refused (the shards
    written hold a shuffle of the old listing), naming the folders that changed, and the source
    put back resumes. A file the layout does not read (notes, a thumbnail) is no change: its
    edit blocked the resume, and the refusal named no folder."""
    raw, args = tmp_path / "raw", ["--shard-size", "2", "--workers", "1"]
    write_images(raw, [f"{c}/{i:04d}.jpg" for c in ("cat", "dog") for i in range(5)])

    def killed(out, at):
        proc = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(raw), str(out), str(at)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr

    def prepared(out):
        return run_launcher("prepare_data.py", "imagefolder", "--src", str(raw), "--out",
                            str(out), *args)
    killed(tmp_path / "early", 0)  # listed, then killed before its first shard
    write_images(raw / "cat", ["0005.jpg"])
    proc = prepared(tmp_path / "early")
    assert proc.returncode == 0, proc.stderr
    assert f"{raw} changed (files added, removed or rewritten in 'cat' since this run listed " \
           f"it), before any shard was written: listing it again" in proc.stderr
    assert read_info(tmp_path / "early").splits["train"].num_samples == 11

    killed(tmp_path / "late", 2)  # 2 of its 6 shards written
    before = {p: p.read_bytes() for p in (tmp_path / "late").iterdir() if p.is_file()}
    added = raw / "dog" / "0009.jpg"
    write_images(raw / "dog", ["0009.jpg"])
    proc = prepared(tmp_path / "late")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: {raw} changed (files added, removed or rewritten in 'dog' since this run listed "
        f"it), and shards of that listing are written in {tmp_path / 'late'}; put the source back "
        f"as it was to resume, or start afresh in a new output folder (--out, or --stage for a "
        f"remote --out)"), proc.stderr
    assert {p: p.read_bytes() for p in (tmp_path / "late").iterdir() if p.is_file()} == before
    # put back (an image copied over with new times is no change): the rerun resumes, to
    # what an uninterrupted run writes
    added.unlink()
    os.utime(raw / "cat" / "0001.jpg", ns=(0, 0))
    (raw / "cat" / "notes.txt").write_text("not read: no change")
    (raw / "Thumbs.db").write_bytes(b"\0" * 64)
    resumed = prepared(tmp_path / "late")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 2 of 6 shards are complete" in resumed.stderr
    assert prepared(tmp_path / "whole").returncode == 0
    whole = sorted(p.name for p in (tmp_path / "whole").glob("*.tar"))
    assert len(whole) == 6 and whole == sorted(p.name for p in (tmp_path / "late").glob("*.tar"))
    for name in whole:
        assert (tmp_path / "late" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()

    # finished, then a shard lost and the source changed: the lost shard was written from a
    # new shuffle next to the old ones (images twice, others missing, not a word said)
    lost = tmp_path / "whole" / whole[2]
    kept = lost.read_bytes()
    lost.unlink()
    write_images(raw / "dog", ["0009.jpg"])
    proc = prepared(tmp_path / "whole")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: {raw} changed (files added, removed or rewritten in 'dog' since this run "
        f"listed it), and shards of that listing are written in {tmp_path / 'whole'}"), \
        proc.stderr
    assert not lost.exists()
    added.unlink()
    proc = prepared(tmp_path / "whole")
    assert proc.returncode == 0, proc.stderr
    assert lost.read_bytes() == kept
    # every file of it deleted (its hidden bookkeeping left): nothing of the old listing is
    # kept, so a changed source is listed again, not refused
    for p in (tmp_path / "whole").iterdir():
        if p.is_file():
            p.unlink()
    write_images(raw / "dog", ["0009.jpg"])
    proc = prepared(tmp_path / "whole")
    assert proc.returncode == 0, proc.stderr
    assert read_info(tmp_path / "whole").splits["train"].num_samples == 12


def test_a_folder_the_layout_does_not_read_may_change_before_a_lost_shard_is_rewritten(
        tmp_path):
    """train/ and val/ are read; test/ (unlabelled images), extras/ and an image loose beside
    them are left out, the last now with a warning. Images added to those folders after the
    output lost a shard blocked its rewrite as a changed source; now the shard comes back as it
    was. An image added to train/ still blocks it."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    write_images(raw, [f"{split}/{c}/{i:04d}.jpg" for split in ("train", "val")
                       for c in ("cat", "dog") for i in range(3)]
                 + ["test/0000.jpg", "extras/cat/0000.jpg", "IMG_0001.jpg"])

    def prepared():
        return run_launcher("prepare_data.py", "imagefolder", "--src", str(raw), "--out",
                            str(out), "--shard-size", "2", "--workers", "1")
    first = prepared()
    assert first.returncode == 0, first.stderr
    # an image loose beside the splits has no label: said, not dropped unseen
    assert f"left out 1 image loose in {raw}, beside its split folders (e.g. IMG_0001.jpg): " \
           f"move them into a class folder of a split to have them" in first.stderr
    lost = sorted(out.glob("*-train-*.tar"))[1]
    kept = lost.read_bytes()
    lost.unlink()
    write_images(raw, ["test/0001.jpg", "extras/dog/0000.jpg", "IMG_0002.jpg"])
    proc = prepared()
    assert proc.returncode == 0, proc.stderr
    assert lost.read_bytes() == kept
    lost.unlink()
    write_images(raw, ["train/dog/0009.jpg"])
    proc = prepared()
    assert proc.returncode == 2 and "changed (files added, removed or rewritten in " \
        "'train/dog' since this run listed it)" in proc.stderr, proc.stderr


def test_macos_leftovers_cleared_away_between_runs_are_no_change(tmp_path):
    """Deleting the __MACOSX folder (never read) before the rerun of an interrupted run blocked
    its resume as a changed source, under fingerprints kept by earlier versions too."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    write_images(raw, [f"{c}/{i:04d}.jpg" for c in ("cat", "dog") for i in range(5)]
                 + ["__MACOSX/cat/0000.jpg"])
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(raw), str(out), "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [scan] = out.rglob("scan.json")
    state = json.loads(scan.read_text())  # as the versions that counted __MACOSX kept it
    state["src_fingerprint"].update({"__MACOSX": "0" * 64, "__MACOSX/cat": "1" * 64})
    scan.write_text(json.dumps(state))
    for leftover in sorted((raw / "__MACOSX").rglob("*"), reverse=True) + [raw / "__MACOSX"]:
        leftover.unlink() if leftover.is_file() else leftover.rmdir()
    resumed = run_launcher("prepare_data.py", "imagefolder", "--src", str(raw), "--out",
                           str(out), "--shard-size", "2", "--workers", "1")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 2 of 5 shards are complete" in resumed.stderr


def test_a_class_folder_link_that_leads_nowhere_is_refused(tmp_path):
    """A class folder linked from a file system not mounted here was left out without a word,
    and every later class took another label."""
    raw = tmp_path / "raw"
    write_images(raw, [f"{c}/0000.jpg" for c in ("ant", "bee", "dog")])
    (raw / "cat").symlink_to(tmp_path / "unmounted" / "cat")
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(raw), "--out",
                        str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: {raw / 'cat'} is a link to {tmp_path / 'unmounted' / 'cat'}, which is not there; "
        f"mount what it leads to, or remove the link"), proc.stderr
    (tmp_path / "unmounted" / "cat").mkdir(parents=True)
    write_images(tmp_path / "unmounted", ["cat/0000.jpg"])
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(raw), "--out",
                        str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert read_info(tmp_path / "out").classes == ["ant", "bee", "cat", "dog"]


def test_a_run_interrupted_under_the_fingerprint_of_older_versions_resumes(tmp_path):
    """Older versions kept one digest of the whole source: their interrupted runs resume as
    long as the source is as that digest says, and are refused when it is not."""
    from pretrain.data.sources import _fingerprint_before_folders
    raw, out = tmp_path / "raw", tmp_path / "out"
    write_images(raw, [f"{c}/{i:04d}.jpg" for c in ("cat", "dog") for i in range(5)])
    (raw / "cat" / "notes.txt").write_text("read by the older versions' digest")
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(raw), str(out), "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [scan] = out.rglob("scan.json")
    state = json.loads(scan.read_text())
    state["src_fingerprint"] = _fingerprint_before_folders(str(raw))
    scan.write_text(json.dumps(state))
    args = ["prepare_data.py", "imagefolder", "--src", str(raw), "--out", str(out),
            "--shard-size", "2", "--workers", "1"]
    os.utime(raw / "cat" / "notes.txt", ns=(0, 0))  # what that digest counted: refused
    refused = run_launcher(*args)
    assert refused.returncode == 2 and f"error: {raw} changed (files added, removed or " \
        f"rewritten since this run listed it)" in refused.stderr, refused.stderr
    state["src_fingerprint"] = _fingerprint_before_folders(str(raw))
    scan.write_text(json.dumps(state))
    resumed = run_launcher(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 2 of 5 shards are complete" in resumed.stderr


# launch/prepare_data.py as a user runs it, sent SIGTERM (a job's time limit) by the system as it
# sets about its shard number AT
SIGNALLED_CLI = r'''
import os, runpy, signal, sys
from pretrain.data import shard_writer
at, calls, write = int(sys.argv[1]), [], shard_writer.write_shard

def signalled_at(job):
    calls.append(job)
    if len(calls) == at + 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return write(job)

shard_writer.write_shard = signalled_at
sys.argv = ["launch/prepare_data.py", *sys.argv[2:]]
sys.path.insert(0, "launch")  # as running the script puts its folder first
runpy.run_path("launch/prepare_data.py", run_name="__main__")
'''


def test_sigterm_stops_prepare_data_with_a_word_and_the_rerun_finishes_the_same(tmp_path):
    """A time limit's SIGTERM ended the run in silence; now it says so, as Ctrl-C does."""
    from conftest import REPO

    raw = tmp_path / "raw"
    write_images(raw, [f"{c}/{i:04d}.jpg" for c in ("cat", "dog") for i in range(5)])
    args = ["imagefolder", "--src", str(raw), "--shard-size", "2", "--workers", "1"]
    proc = subprocess.run([sys.executable, "-c", SIGNALLED_CLI, "2", *args, "--out",
                           str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("stopped by SIGTERM; rerun the same command "
                                                    "to resume"), proc.stderr
    assert not (tmp_path / "out" / "_info.json").exists()
    again = run_launcher("prepare_data.py", *args, "--out", str(tmp_path / "out"))
    assert again.returncode == 0 and "resuming: 2 of 5 shards are complete" in again.stderr, \
        again.stderr
    whole = run_launcher("prepare_data.py", *args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0
    names = sorted(p.name for p in (tmp_path / "whole").glob("*.tar"))
    assert names == sorted(p.name for p in (tmp_path / "out").glob("*.tar")) and len(names) == 5
    for name in names:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
