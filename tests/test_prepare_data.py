"""Raw datasets in every layout -> shuffled WebDataset shards, checked the way a user would.

The raw data are real JPEG/PNG/WebP bytes in real tars, folders and pickles (pretrain.data.synthetic);
the shards are read back with tarfile and with timm's own WebDataset reader.
"""
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image

from conftest import REPO, run_launcher
from pretrain.data import synthetic
from pretrain.data.info import read_info
from pretrain.data.shard_plan import build_index
from pretrain.data.shard_writer import prepare
from pretrain.data.sources import Entry, PrepareError, load_synsets, timm_info_file

GOOG = load_synsets("goog")
FALL11 = load_synsets("fall11")
# Synsets spread over the list, so a label off by one or taken from the wrong list shows.
I21K_SYNSETS = [GOOG[i] for i in (3, 1000, 5555, 9999, 15000, 21842)]
PER_CLASS = 20


def read_tar(path):
    """[(key, {ext: bytes})] in the order stored, grouped the way webdataset groups members."""
    samples = []
    with tarfile.open(path) as tar:
        for m in tar:
            base = os.path.basename(m.name)
            key = os.path.join(os.path.dirname(m.name), base.split(".", 1)[0])
            ext = base.split(".", 1)[1]
            if not samples or samples[-1][0] != key:
                samples.append((key, {}))
            samples[-1][1][ext] = tar.extractfile(m).read()
    return samples


def read_output(out):
    """Every sample of every split as dicts: split, shard, key, cls, meta, jpg."""
    info = json.loads((Path(out) / "_info.json").read_text())
    samples = []
    for split, s in info["splits"].items():
        for filename in s["filenames"]:
            for key, files in read_tar(Path(out) / filename):
                samples.append(dict(split=split, shard=filename, key=key, cls=int(files["cls"]),
                                    meta=json.loads(files["json"]), jpg=files["jpg"]))
    return samples


def assert_matches_raw(out, raw):
    """Each readable raw image exactly once, in its split, with the label of its class."""
    samples = read_output(out)
    keys = [s["key"] for s in samples]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(raw.samples)
    for s in samples:
        split, class_name = raw.samples[s["key"]]
        assert s["cls"] == s["meta"]["label"] == raw.classes.index(class_name)
        assert s["meta"]["class_name"] == class_name
        if split != "train":  # training images may be held out; the others keep their split
            assert s["split"] == split
    return samples


def snapshot(out):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(out).rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def i21k(tmp_path_factory):
    """Per-synset tars with gray, CMYK, PNG-as-JPEG and truncated members, and their shards."""
    root = tmp_path_factory.mktemp("i21k")
    raw = synthetic.write_synset_tars(root / "raw", I21K_SYNSETS, PER_CLASS, oddities=True)
    info = prepare("imagenet21k", str(raw.root), str(root / "out"), shard_size=16, val_count=20,
                   progress=False)
    return raw, root / "out", info


def test_i21k_every_image_once_with_its_synset_label(i21k):
    raw, out, info = i21k
    raw.classes = GOOG  # labels are line numbers of the whole 21843-synset list
    samples = assert_matches_raw(out, raw)
    assert info.classes == GOOG and len(info.classes) == 21843
    assert Counter(s["split"] for s in samples) == {"train": len(raw.samples) - 20, "validation": 20}


def test_i21k_shards_are_shuffled_across_classes(i21k):
    _, out, _ = i21k
    by_shard = defaultdict(list)
    for s in read_output(out):
        by_shard[s["shard"]].append(s["cls"])
    for shard, labels in by_shard.items():
        if len(labels) >= 12:
            assert Counter(labels).most_common(1)[0][1] <= len(labels) // 2, (shard, labels)
    train_shards = [labels for shard, labels in by_shard.items() if "-train-" in shard]
    assert all(len(set(labels)) >= 4 for labels in train_shards[:-1])


def test_i21k_info_counts_match_the_tars(i21k):
    _, out, _ = i21k
    info = read_info(out)
    on_disk = sorted(p.name for p in out.glob("*.tar"))
    assert sorted(f for s in info.splits.values() for f in s.filenames) == on_disk
    for split in info.splits.values():
        lengths = [len(read_tar(out / f)) for f in split.filenames]
        assert split.shard_lengths == lengths
        assert split.num_samples == sum(lengths)
        assert all(f.startswith(f"imagenet21k-{split.name}-") for f in split.filenames)
    assert info.split("train").shard_lengths[0] == 16


def test_i21k_odd_images_become_rgb_jpegs_and_the_corrupt_one_is_reported(i21k):
    raw, out, info = i21k
    samples = {s["key"]: s for s in read_output(out)}
    for s in samples.values():
        img = Image.open(io.BytesIO(s["jpg"]))
        assert img.format == "JPEG"
        assert img.convert("RGB").size == (s["meta"]["width"], s["meta"]["height"]) == (64, 48)
    assert Image.open(io.BytesIO(samples[raw.special["gray"]]["jpg"])).mode == "L"  # kept as is
    for odd in ("cmyk", "png"):
        assert Image.open(io.BytesIO(samples[raw.special[odd]]["jpg"])).mode == "RGB"
    with tarfile.open(raw.root / f"{I21K_SYNSETS[1]}.tar") as tar:  # plain JPEGs keep their bytes
        original = tar.extractfile(f"{I21K_SYNSETS[1]}_1.JPEG").read()
    assert samples[f"{I21K_SYNSETS[1]}_1"]["jpg"] == original

    report = json.loads((out / "_skipped.json").read_text())
    assert report["num_skipped"] == 1 == info.extra["num_skipped"]
    assert [r["key"] for r in report["skipped"]] == raw.corrupt
    assert "truncated" in report["skipped"][0]["error"]


def test_outer_tar_gz_stream_gives_the_same_shards(i21k, tmp_path):
    raw, out, _ = i21k
    tars = sorted(raw.root.glob("*.tar"), reverse=True)  # stream order must not matter
    outer = synthetic.write_outer_tar(tmp_path / "winter21_whole.tar.gz", tars)
    info = prepare("imagenet21k", str(outer), str(tmp_path / "out"), shard_size=16, val_count=20,
                   progress=False)
    assert info.splits == read_info(out).splits
    for f in out.glob("*.tar"):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()
    assert not (tmp_path / "out" / ".prepare" / "spill").exists()  # the spilled images are cleaned up


# Runs prepare() with the journal saved at every inner tar (and small spill files) and sends the
# process SIGNAL (KILL:
# no cleanup runs; STOP: paused, as by Ctrl-Z) once the scan has listed AT images, in the middle
# of an inner tar.
KILLED_SCAN = r'''
import os, signal, sys
from pretrain.data import imagenet21k, scan_journal
from pretrain.data.shard_writer import prepare
kind, src, out, at, signame, workers = (sys.argv[1:] + ["KILL", "1"][len(sys.argv) - 5:])[:6]
sig = getattr(signal, "SIG" + signame)
scan_journal.SAVE_EVERY_S = 0
imagenet21k.SPILL_FILE_BYTES = 40_000  # a few spill files, as 1 GiB ones over ImageNet-21k
listed = getattr(imagenet21k, kind).entries

def entries_until_killed(self, journal=None):
    for n, entry in enumerate(listed(self, journal)):
        if n == int(at):
            os.kill(os.getpid(), sig)
        yield entry

setattr(getattr(imagenet21k, kind), "entries", entries_until_killed)
prepare("imagenet21k", src, out, shard_size=16, val_count=20, progress=False,
        workers=int(workers))
'''


@pytest.mark.parametrize("layout", ["synset tars", "fall11_whole.tar", "winter21_whole.tar.gz"])
def test_an_index_pass_killed_midway_goes_on_where_it_was_cut_off(i21k, tmp_path, layout,
                                                                  fault_ledger):
    """The first pass over ImageNet-21k takes hours: a rerun after a kill in the middle of an
    inner tar reads on from the last inner tar it had saved, and writes the same shards; also
    with --skip-unknown added, as the error on an unknown synset advises (an option the
    listing so far holds under: it was thrown away with every change of options)."""
    raw, out, _ = i21k
    if layout == "synset tars":
        src, kind = raw.root, "SynsetTars"
    else:
        src, kind = synthetic.write_outer_tar(tmp_path / layout, sorted(raw.root.glob("*.tar"))), \
            "OuterTarStream"
    killed = subprocess.run([sys.executable, "-c", KILLED_SCAN, kind, str(src),
                             str(tmp_path / "out"), str(2 * PER_CLASS + 5)],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    journal = json.loads((tmp_path / "out/.prepare/scan/state.json").read_text())
    assert len(journal["chunks"]) == 2  # two inner tars listed and saved, the third cut off
    if kind == "OuterTarStream":  # their images spilled over several files
        assert len(journal["parts"]) > 1, journal
    proc = run_launcher("prepare_data.py", "imagenet21k", "--src", str(src), "--out",
                        str(tmp_path / "out"), "--shard-size", "16", "--val-count", "20",
                        "--skip-unknown")
    assert proc.returncode == 0, proc.stderr
    assert "options changed since the last try (--skip-unknown False (now True)): its listing " \
           "of the source is kept" in proc.stderr, proc.stderr
    unit = "of 6 tars" if layout == "synset tars" else "of the stream of"
    assert re.search(rf"index: going on (after 2|at byte \d+) {unit}", proc.stderr), proc.stderr
    assert ("index: decompressing" in proc.stderr) == layout.endswith(".gz"), proc.stderr
    for f in out.glob("*.tar"):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    assert read_info(tmp_path / "out").splits == read_info(out).splits
    assert not (tmp_path / "out/.prepare/scan").exists()  # the journal is gone with the pass
    fault_ledger.record(1, 0)


def test_a_killed_run_leaves_no_worker_process_behind(tmp_path):
    """Pool workers outlived a SIGKILL of their parent, finishing their tasks (holding the
    output folder's lock meanwhile: a rerun was refused) and then printing a BrokenPipeError
    traceback each. They now die with it, in the listing pool (here) and the writing pool alike
    (the same start-up)."""
    # listings more than a pipe holds: the workers are still sending when their parent dies
    raw = synthetic.write_synset_tars(tmp_path / "raw", GOOG[:40], 200, size=(8, 8))
    killed = subprocess.run([sys.executable, "-c", KILLED_SCAN, "SynsetTars", str(raw.root),
                             str(tmp_path / "out"), "45", "KILL", "2"],
                            capture_output=True, text=True, timeout=120)
    # the output ends when every holder of the pipe is gone: the workers too
    assert killed.returncode == -signal.SIGKILL and "Traceback" not in killed.stderr, \
        killed.stderr
    args = ["imagenet21k", "--src", str(raw.root), "--shard-size", "16", "--val-count", "20",
            "--workers", "2"]
    again = run_launcher("prepare_data.py", *args, "--out", str(tmp_path / "out"))
    assert again.returncode == 0, again.stderr
    whole = run_launcher("prepare_data.py", *args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    for f in (tmp_path / "whole").glob("*.tar"):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name


# prepare() with 2 workers, one of which is killed (the OOM killer, say) on its task for the
# third tar of the listing, or for the fourth train shard of the writing
DYING_WORKER = r'''
import os, signal, sys
from pretrain.data import imagenet21k, shard_writer
src, out, stage = sys.argv[1:4]
parent = os.getpid()
module, name = (imagenet21k, "_list_tar") if stage == "list" else (shard_writer, "write_shard")
task = getattr(module, name)

def dies(item):
    chosen = (os.path.basename(item) == sorted(os.listdir(src))[2] if stage == "list"
              else item[0].endswith("-train-000003.tar"))
    if os.getpid() != parent and chosen:
        os.kill(os.getpid(), signal.SIGKILL)
    return task(item)

setattr(module, name, dies)
shard_writer.prepare("imagenet21k", src, out, shard_size=16, val_count=20, workers=2,
                     progress=False)
'''


@pytest.mark.parametrize("stage", ["list", "write"])
def test_a_worker_killed_mid_task_is_an_error_not_a_hang(i21k, tmp_path, stage, fault_ledger):
    """multiprocessing.Pool waits forever for the task of a worker that died; now the run
    ends with an error naming it, and the rerun resumes."""
    raw, out, _ = i21k
    dead = subprocess.run([sys.executable, "-c", DYING_WORKER, str(raw.root),
                           str(tmp_path / "out"), stage], capture_output=True, text=True,
                          timeout=120)
    assert dead.returncode == 1, dead.stderr
    assert dead.stderr.strip().splitlines()[-1] == ("pretrain.helper_processes.WorkerDied: a "
                                                    "worker process of 2 died (the OOM killer, "
                                                    "or a signal)"), dead.stderr
    again = run_launcher("prepare_data.py", "imagenet21k", "--src", str(raw.root), "--out",
                         str(tmp_path / "out"), "--shard-size", "16", "--val-count", "20")
    assert again.returncode == 0, again.stderr
    for f in out.glob("*.tar"):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    fault_ledger.record(1, 0)


def test_a_spill_file_that_cannot_be_written_is_named_not_blamed_on_the_source(i21k, tmp_path):
    """The disk the output is prepared on takes no file over 100 kB (a real limit of the
    kernel's, RLIMIT_FSIZE: any write error of that disk will do), so the first spill file
    fails to grow. That was reported as "cannot read SRC as a tar ...; check the download is
    complete"; it names the spill file now, exit 1 (rerun to resume)."""
    import resource
    raw, _, _ = i21k
    src = synthetic.write_outer_tar(tmp_path / "fall11_whole.tar", sorted(raw.root.glob("*.tar")))

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal's end
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch/prepare_data.py"), "imagenet21k", "--src", str(src),
         "--out", str(tmp_path / "out"), "--shard-size", "16", "--val-count", "20"],
        capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert proc.returncode == 1, proc.stderr
    spill = tmp_path / "out/.prepare/spill/spill-00000.bin"
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: [Errno 27] File too large: '{spill}', writing under {tmp_path / 'out'} ("), \
        proc.stderr
    assert "download is complete" not in proc.stderr


def test_a_shard_that_cannot_be_written_names_the_output_folder_and_the_rerun_resumes(tmp_path):
    """A full disk, a quota or a file-size limit while a shard is written: the error names no
    file ("[Errno 27] File too large" was all the line said). It names the output folder and
    the room left there now, and the same command, rerun once there is room, completes."""
    import resource
    for c in range(2):
        for i in range(8):
            path = tmp_path / "src" / f"c{c}" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(synthetic.class_image(c, 2, np.random.default_rng(i), (96, 96), "PNG"))
    cmd = [sys.executable, str(REPO / "launch/prepare_data.py"), "imagefolder", "--src",
           str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--shard-size", "16",
           "--val-count", "2", "--workers", "1"]

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal's end
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(re.escape(f"error: [Errno 27] File too large, writing under "
                                  f"{tmp_path / 'out'} (") + r"\d+\.\d GiB free there\); make "
                        r"room there \(or raise the quota or the file-size limit, `ulimit -f`\) "
                        r"and rerun the same command to resume", line), line
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    info = read_info(tmp_path / "out")
    assert {n: s.num_samples for n, s in info.splits.items()} == {"train": 14, "validation": 2}


def test_a_source_or_spill_changed_after_a_killed_index_pass_is_scanned_again(i21k, tmp_path):
    raw, out, _ = i21k
    src = synthetic.write_outer_tar(tmp_path / "fall11_whole.tar", sorted(raw.root.glob("*.tar")))
    killed = subprocess.run([sys.executable, "-c", KILLED_SCAN, "OuterTarStream", str(src),
                             str(tmp_path / "out"), str(2 * PER_CLASS + 5)], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    os.utime(src, ns=(0, 0))  # downloaded again, say
    proc = run_launcher("prepare_data.py", "imagenet21k", "--src", str(src), "--out",
                        str(tmp_path / "out"), "--shard-size", "16", "--val-count", "20")
    assert proc.returncode == 0, proc.stderr
    assert f"{src} changed since the interrupted index pass: scanning it again from the start" \
        in proc.stderr and "going on" not in proc.stderr
    for f in out.glob("*.tar"):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    # the same when someone cleaned the work folder's spilled images in between
    killed = subprocess.run([sys.executable, "-c", KILLED_SCAN, "OuterTarStream", str(src),
                             str(tmp_path / "again"), str(2 * PER_CLASS + 5)], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    shutil.rmtree(tmp_path / "again/.prepare/spill")
    proc = run_launcher("prepare_data.py", "imagenet21k", "--src", str(src), "--out",
                        str(tmp_path / "again"), "--shard-size", "16", "--val-count", "20")
    assert proc.returncode == 0, proc.stderr
    assert "the spill files of the interrupted index pass are gone" in proc.stderr
    for f in out.glob("*.tar"):
        assert (tmp_path / "again" / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_second_run_on_the_same_folder_is_refused_while_the_first_works(i21k, tmp_path):
    raw, out, _ = i21k
    args = ["imagenet21k", "--src", str(raw.root), "--out", str(tmp_path / "out"),
            "--shard-size", "16", "--val-count", "20"]
    first = subprocess.Popen([sys.executable, "-c", KILLED_SCAN, "SynsetTars", str(raw.root),
                              str(tmp_path / "out"), str(PER_CLASS + 5), "STOP"])
    try:
        wait = psutil.Process(first.pid)
        while wait.status() != psutil.STATUS_STOPPED:  # paused in its index pass, lock held
            assert first.poll() is None
            time.sleep(0.05)
        second = run_launcher("prepare_data.py", *args)
        assert second.returncode == 2 and second.stderr.strip().splitlines()[-1] == (
            f"error: another prepare_data.py (pid {first.pid}) is writing {tmp_path / 'out'}; "
            f"wait for it to finish, or stop it and rerun to resume")
    finally:
        first.kill()
        first.wait()
    again = run_launcher("prepare_data.py", *args)  # the kernel let go of the killed run's lock
    assert again.returncode == 0 and "index: going on after 1 of 6 tars" in again.stderr, \
        again.stderr
    for f in out.glob("*.tar"):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name


def test_the_index_bar_says_how_far_through_the_outer_tar_it_is(i21k, tmp_path):
    raw, _, _ = i21k
    src = synthetic.write_outer_tar(tmp_path / "winter21_whole.tar.gz",
                                    sorted(raw.root.glob("*.tar")))
    proc = run_launcher("prepare_data.py", "imagenet21k", "--src", str(src), "--out",
                        str(tmp_path / "out"), "--shard-size", "16", "--val-count", "20")
    assert proc.returncode == 0, proc.stderr
    # in bytes of the file as stored (compressed): the whole of it, with the images listed
    images = sum(len(tarfile.open(t).getmembers()) for t in raw.root.glob("*.tar"))
    assert re.search(rf"index: 100%\|.*\| (\S+)/\1 \[.*, {images} images\]", proc.stderr), \
        proc.stderr


def test_fall11_list_and_unknown_synsets(tmp_path, caplog):
    synsets = [FALL11[i] for i in (0, 777, 21840)]
    raw = synthetic.write_synset_tars(tmp_path / "raw", synsets + ["n99999999"], 6)
    # a copy from a Mac: an AppleDouble file beside each tar, no synset of its own
    (raw.root / f"._{synsets[0]}.tar").write_bytes(b"\0\5\26\7 resource fork")
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match="n99999999.*--skip-unknown"):
        prepare("imagenet21k", str(raw.root), str(out), synsets="fall11", shard_size=8, val_count=3,
                progress=False)
    # The failed first try wrote no shard, so the corrected command may use the same DIR.
    with caplog.at_level("INFO", logger="pretrain.data.shard_writer"):
        info = prepare("imagenet21k", str(raw.root), str(out), synsets="fall11", shard_size=8,
                       val_count=3, skip_unknown=True, progress=False)
    # the last line said "skipped 0 unreadable files", the class left out only in the report
    assert "skipped 0 unreadable files; left out 1 classes not in the label list " \
           "(--skip-unknown: n99999999) (listed in _skipped.json)" in caplog.text
    raw.samples = {k: v for k, v in raw.samples.items() if v[1] != "n99999999"}
    raw.classes = FALL11
    assert_matches_raw(out, raw)
    assert len(info.classes) == 21841
    assert json.loads((out / "_skipped.json").read_text())["unknown_classes"] == ["n99999999"]
    # the outer tar's folder given as --src: the tar is named as the --src to give
    (tmp_path / "download").mkdir()
    (tmp_path / "download" / "fall11_whole.tar").write_bytes(b"")
    with pytest.raises(PrepareError, match=rf"holds fall11_whole.tar, not per-synset tars "
                                           rf"\(n01440764.tar ...\); an outer tar is read as "
                                           rf"--src itself: --src {tmp_path}/download/"):
        prepare("imagenet21k", str(tmp_path / "download"), str(tmp_path / "out2"),
                progress=False)


def test_imagefolder_any_extension_sorted_classes_and_max_size(tmp_path, caplog):
    raw = synthetic.write_image_folder(tmp_path / "raw", ["zebra", "cat", "dog"], 10)
    with caplog.at_level("WARNING", logger="pretrain.data.shard_writer"):
        info = prepare("imagefolder", str(raw.root), str(tmp_path / "out"), shard_size=8,
                       max_size=40, progress=False)
    assert info.classes == ["cat", "dog", "zebra"]
    # one split, no --val-count: said at once (a run evaluating 'validation' stops at its start)
    assert f"{raw.root} has no held-out images: the dataset gets a train split only" in \
        caplog.text and list(info.splits) == ["train"]
    samples = assert_matches_raw(tmp_path / "out", raw)
    assert len(samples) == 30  # the stray notes.txt files are no images
    for s in samples:
        assert Image.open(io.BytesIO(s["jpg"])).size == (53, 40)  # shorter side down to --max-size
        assert (s["meta"]["width"], s["meta"]["height"]) == (64, 48)  # the original size


def test_a_dataset_whose_images_mostly_do_not_decode_is_refused_and_the_mended_rerun_writes_it(
        tmp_path):
    """A dataset cloned without Git LFS (every .jpg a pointer file), a folder of iPhone HEICs:
    "wrote 0 train ... skipped 6", exit 0, and the output was complete; a rerun after the files
    were mended said "already complete" and kept the empty shards."""
    src = tmp_path / "src"
    for c in ("cat", "dog"):
        (src / "train" / c).mkdir(parents=True)
        for i in range(4):
            (src / "train" / c / f"{i}.jpg").write_bytes(
                b"version https://git-lfs.github.com/spec/v1\noid sha256:%d\nsize 9\n" % i)
    (src / "train" / "dog" / "3.jpg").write_bytes(b"\0\0\0\x18ftypheic" + bytes(16))
    out = tmp_path / "out"
    with pytest.raises(PrepareError) as e:
        prepare("imagefolder", str(src), str(out), shard_size=4, progress=False)
    assert re.fullmatch(rf"8 of 8 images could not be read \(split 'train' left empty\); 7 of "
                        rf"them: a Git LFS pointer, not the image \(git lfs pull\) \(e.g. "
                        rf"{src}/train/(cat|dog)/\d.jpg; all in {out}/_skipped.json\); mend "
                        rf"them and rerun the same command", str(e.value)), str(e.value)
    assert not (out / "_info.json").exists() and not list(out.glob("*.tar"))
    report = json.loads((out / "_skipped.json").read_text())
    assert "a HEIF/AVIF image (heic), which this PIL does not read; convert it to JPEG" in \
        [item["error"] for item in report["skipped"]]
    # mended in place (git lfs pull): the same command writes the dataset
    for i, f in enumerate(sorted((src / "train").rglob("*.jpg"))):
        Image.new("RGB", (16, 16), (30 * i, 0, 0)).save(f, format="JPEG")
    info = prepare("imagefolder", str(src), str(out), shard_size=4, progress=False)
    assert info.split("train").num_samples == 8 and len(read_output(out)) == 8
    # a few broken files among many are skipped and reported, as before
    (src / "train" / "cat" / "0.jpg").write_bytes(b"not an image")
    info = prepare("imagefolder", str(src), str(tmp_path / "out2"), shard_size=4, progress=False)
    assert info.split("train").num_samples == 7 and info.extra["num_skipped"] == 1
    # per-synset tars, three of four of pointers: some shards kept images; the tars mended
    # (rewritten: another size and time) are listed again, as no shard is left
    tars = tmp_path / "i21k"
    synthetic.write_synset_tars(tars, I21K_SYNSETS[:1], 4)
    for synset in I21K_SYNSETS[1:4]:
        with tarfile.open(tars / f"{synset}.tar", "w") as tar:
            for i in range(4):
                data = b"version https://git-lfs.github.com/spec/v1\n"
                member = tarfile.TarInfo(f"{synset}_{i}.JPEG")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    with pytest.raises(PrepareError, match=r"^12 of 16 images could not be read"):
        prepare("imagenet21k", str(tars), str(tmp_path / "out3"), shard_size=1, val_count=2,
                progress=False)
    synthetic.write_synset_tars(tars, I21K_SYNSETS[:4], 4)
    info = prepare("imagenet21k", str(tars), str(tmp_path / "out3"), shard_size=1,
                   val_count=2, progress=False)
    assert info.split("train").num_samples == 14 and info.extra["num_skipped"] == 0


@pytest.mark.parametrize("flat_val", [False, True], ids=["val-in-folders", "flat-val-with-csv"])
def test_imagenet1k_uses_timms_synset_order(tmp_path, flat_val, caplog):
    order = timm_info_file("imagenet_synsets.txt").read_text().split()
    raw = synthetic.write_imagenet1k(tmp_path / "raw", [order[1], order[500], order[999]], 6, 3,
                                     flat_val=flat_val, all_synsets=order)
    if flat_val:  # the label file of the whole set, the images of a part: said
        labels = raw.root / "LOC_val_solution.csv"
        labels.write_text(labels.read_text() + "ILSVRC2012_val_00049999,n01440764 1 2 3 4\n")
    with caplog.at_level("WARNING", logger="pretrain.data.folders"):
        info = prepare("imagenet1k", str(raw.root), str(tmp_path / "out"), shard_size=8,
                       progress=False)
    assert info.classes == order
    # a part of ImageNet-1k prepared: the absent classes were not said
    assert f"997 of the 1000 classes of the label list have no training images (e.g. " \
           f"{order[0]}, {order[2]}, {order[3]}): their labels are kept, with no samples" \
        in caplog.text
    assert ("the validation label file names 10 images, 1 of them not in" in caplog.text) \
        == flat_val
    samples = assert_matches_raw(tmp_path / "out", raw)
    assert Counter(s["split"] for s in samples) == {"train": 18, "validation": 9}


def test_a_flat_val_label_index_beyond_the_1000_classes_is_one_line(tmp_path):
    order = timm_info_file("imagenet_synsets.txt").read_text().split()
    raw = synthetic.write_imagenet1k(tmp_path / "raw", [order[1]], 2, 2, flat_val=True,
                                     all_synsets=order)
    (raw.root / "LOC_val_solution.csv").unlink()
    # the devkit's ground truth counts from 1: its 1000 is one past timm's last index
    (raw.root / "val.txt").write_text("ILSVRC2012_val_00000001.JPEG 1\n"
                                      "ILSVRC2012_val_00000002.JPEG 1000\n")
    with pytest.raises(PrepareError, match=r"val.txt: class index 1000 for "
                                           r"ILSVRC2012_val_00000002.JPEG is beyond the 1000 "
                                           r"classes; indices count from 0 in timm's synset order"):
        prepare("imagenet1k", str(raw.root), str(tmp_path / "out"), progress=False)


def test_imagenet1k_as_it_is_downloaded(tmp_path):
    """Kaggle's download (LOC_val_solution.csv three levels above CLS-LOC/, saved again with a
    BOM), ILSVRC2012_img_train.tar unpacked once (a tar per synset), the devkit's one-column
    ground truth given as val.txt: each was refused with a line that missed the point, one only
    after train/ was listed (an hour over 1.28 M files on a network file system)."""
    order = timm_info_file("imagenet_synsets.txt").read_text().split()
    kaggle = tmp_path / "kaggle"
    raw = synthetic.write_imagenet1k(kaggle / "ILSVRC" / "Data" / "CLS-LOC", order[:2], 2, 2,
                                     flat_val=True, all_synsets=order)
    csv_file = raw.root / "LOC_val_solution.csv"
    (kaggle / csv_file.name).write_text("\ufeff" + csv_file.read_text(), encoding="utf-8")
    csv_file.unlink()
    info = prepare("imagenet1k", str(raw.root), str(tmp_path / "out"), progress=False)
    assert info.split("validation").num_samples == 4
    samples = assert_matches_raw(tmp_path / "out", raw)
    assert len(samples) == 8

    (kaggle / csv_file.name).unlink()
    (raw.root / "val.txt").write_text("65\n970\n230\n809\n")  # ids, in the devkit's order
    with pytest.raises(PrepareError, match=r"val.txt has one value per line and no file names "
                                           r"\(the devkit's ILSVRC2012_validation_ground_truth"):
        prepare("imagenet1k", str(raw.root), str(tmp_path / "out2"), progress=False)

    train = raw.root / "train"
    for synset in order[:2]:
        with tarfile.open(train / f"{synset}.tar", "w") as tar:
            tar.add(train / synset, arcname=".")
        shutil.rmtree(train / synset)
    with pytest.raises(PrepareError, match=rf"^{train} holds per-synset tars \({order[0]}.tar, "
                                           rf"... 2 of them\), as ILSVRC2012_img_train.tar "
                                           rf"unpacks; extract each"):
        prepare("imagenet1k", str(raw.root), str(tmp_path / "out3"), progress=False)
    (tmp_path / "ILSVRC2012_img_train.tar").write_bytes(b"")
    with pytest.raises(PrepareError, match=r"is a tar; extract it into train/"):
        prepare("imagenet1k", str(tmp_path / "ILSVRC2012_img_train.tar"), str(tmp_path / "out4"),
                progress=False)


@pytest.mark.parametrize("kind", ["cifar10", "cifar100"])
def test_cifar_pickles_keep_labels_and_pixels(tmp_path, kind):
    raw = synthetic.write_cifar(tmp_path / "raw", kind, n_train=40, n_test=12)
    info = prepare(kind, str(tmp_path / "raw"), str(tmp_path / "out"), shard_size=16, progress=False)
    assert {n: s.num_samples for n, s in info.splits.items()} == {"train": 40, "test": 12}
    samples = assert_matches_raw(tmp_path / "out", raw)
    with open(raw.root / ("test_batch" if kind == "cifar10" else "test"), "rb") as f:
        rows = pickle.load(f)["data"]  # our own file: plain pickle is safe here
    pixels = rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # CIFAR rows are channel-major
    for s in samples:
        if s["split"] == "test":
            decoded = np.asarray(Image.open(io.BytesIO(s["jpg"])).convert("RGB"), dtype=np.float32)
            row = int(s["key"].split("_")[1])
            # JPEG is lossy; a channel-order or transposition mistake would be far off.
            assert np.abs(decoded - pixels[row]).mean() < 6


def test_cifar_labels_re_saved_as_numpy_ints_prepare_as_the_downloaded_files(tmp_path):
    """A script that loaded the batches and saved them again may leave the labels a numpy
    array, or a list of numpy ints: they were refused, the array as "not N ints", the list as a
    pickle that is no CIFAR batch ("download the python version"), though the user had it."""
    raw = synthetic.write_cifar(tmp_path / "raw", "cifar10", n_train=20, n_test=8)
    prepare("cifar10", str(raw.root), str(tmp_path / "out"), shard_size=8, progress=False)
    for how, relabel in (("array", np.array), ("list", lambda y: list(np.array(y))),
                         ("uint8", lambda y: np.array(y, np.uint8))):
        copy = tmp_path / how / raw.root.name
        shutil.copytree(raw.root, copy)
        for f in copy.glob("*_batch*"):
            with open(f, "rb") as fh:
                batch = pickle.load(fh)  # our own file: plain pickle is safe here
            batch["labels"] = relabel(batch["labels"])
            f.write_bytes(pickle.dumps(batch))
        prepare("cifar10", str(copy), str(tmp_path / f"out-{how}"), shard_size=8,
                progress=False)
        for shard in (tmp_path / "out").glob("*.tar"):
            assert (tmp_path / f"out-{how}" / shard.name).read_bytes() == shard.read_bytes()
    batch["labels"] = np.array(batch["labels"], np.float32)  # not a class index: refused
    (copy / "data_batch_1").write_bytes(pickle.dumps(batch))
    with pytest.raises(PrepareError, match=r"data_batch_1 does not hold a dict with 'data' "
                                           r"\(N x 3072 uint8\) and 'labels' \(N ints\)"):
        prepare("cifar10", str(copy), str(tmp_path / "out-float"), progress=False)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


@pytest.mark.faults
def test_cifar_refuses_pickles_that_are_not_cifar_batches(tmp_path, fault_ledger):
    raw = synthetic.write_cifar(tmp_path / "raw", "cifar10", n_train=10, n_test=5)
    marker = tmp_path / "code-ran"
    (raw.root / "data_batch_2").write_bytes(pickle.dumps({"data": _Evil(str(marker)), "labels": []}))
    with pytest.raises(PrepareError, match="data_batch_2.*not allowed"):
        prepare("cifar10", str(tmp_path / "raw"), str(tmp_path / "out"), progress=False)
    assert not marker.exists()
    wrong = {"data": np.zeros((2, 100), np.uint8), "labels": [0, 1]}
    (raw.root / "data_batch_2").write_bytes(pickle.dumps(wrong))
    with pytest.raises(PrepareError, match=r"data_batch_2 does not hold .*N x 3072 uint8"):
        prepare("cifar10", str(tmp_path / "raw"), str(tmp_path / "out"), progress=False)
    fault_ledger.record(2, 0)


def test_rerun_resumes_an_interrupted_run_with_identical_output(i21k, tmp_path):
    raw, _, _ = i21k
    out = tmp_path / "out"
    args = dict(shard_size=16, val_count=20, progress=False)
    prepare("imagenet21k", str(raw.root), str(out), **args)
    first = snapshot(out)
    # What a run killed mid-way leaves: no _info.json, three shards recorded in the ledger, one
    # shard renamed but not yet recorded, a half-written temporary file, the rest not started.
    ledger = out / ".prepare" / "shards.jsonl"
    lines = ledger.read_text().splitlines()
    ledger.write_text("\n".join(lines[:3]) + "\n")
    kept = [json.loads(line)["file"] for line in lines[:3]]
    unrecorded, *lost = [json.loads(line)["file"] for line in lines[3:]]
    for f in lost:
        (out / f).unlink()
    (out / (lost[0] + ".tmp")).write_bytes(b"half a shard")
    (out / "_info.json").unlink()
    (out / "_skipped.json").unlink()

    prepare("imagenet21k", str(raw.root), str(out), **args)
    second = snapshot(out)
    assert not list(out.glob("*.tmp"))
    for f in kept:  # complete shards are not written again
        assert second[out / f][1] == first[out / f][1]
    assert second[out / unrecorded][1] != first[out / unrecorded][1]
    for path, (data, _) in first.items():
        if path.parent == out:  # the shards, _info.json and the report: byte for byte the same
            assert second[path][0] == data, path.name


def test_a_different_configuration_on_the_same_dir_is_refused(i21k, tmp_path):
    raw, _, _ = i21k
    out = tmp_path / "out"
    prepare("imagenet21k", str(raw.root), str(out), shard_size=16, val_count=20, progress=False)
    before = snapshot(out)
    with pytest.raises(PrepareError, match=r"--shard-size 16 \(now 8\).*choose another --out"):
        prepare("imagenet21k", str(raw.root), str(out), shard_size=8, val_count=20, progress=False)
    (out / "_info.json").unlink()  # a run that stopped before the end records its options too
    del before[out / "_info.json"]
    with pytest.raises(PrepareError, match=r"--seed 0 \(now 1\)"):
        prepare("imagenet21k", str(raw.root), str(out), shard_size=16, val_count=20, seed=1, progress=False)
    assert snapshot(out) == before
    # the same source by another path (a symlinked mount): the unfinished run goes on...
    (tmp_path / "mnt").symlink_to(raw.root)
    prepare("imagenet21k", str(tmp_path / "mnt"), str(out), shard_size=16, val_count=20,
            progress=False)
    assert snapshot(out).keys() == {*before, out / "_info.json"}
    # ... and a finished one is complete, the source moved since (it is not read again)
    done = snapshot(out)
    prepare("imagenet21k", str(tmp_path / "moved"), str(out), shard_size=16, val_count=20,
            progress=False)
    assert snapshot(out) == done
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("keep me")
    with pytest.raises(PrepareError, match=r"other is not empty \(mine.txt\) and holds no "):
        prepare("imagenet21k", str(raw.root), str(tmp_path / "other"), progress=False)


def test_parallel_workers_write_the_same_shards(i21k, tmp_path):
    raw, out, _ = i21k
    prepare("imagenet21k", str(raw.root), str(tmp_path / "out"), shard_size=16, val_count=20, workers=2,
            progress=False)
    for f in out.glob("*.tar"):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()


@pytest.mark.parametrize("split", ["train", "validation"])
def test_timm_reads_the_shards(i21k, split):
    from timm.data import create_dataset

    _, out, info = i21k
    expected = Counter(s["cls"] for s in read_output(out) if s["split"] == split)
    dataset = create_dataset("wds/imagenet21k", root=str(out), split=split)
    seen = Counter()
    for img, target in dataset:
        assert img.mode == "RGB" and img.size == (64, 48)
        seen[target] += 1
    assert seen == expected
    assert sum(seen.values()) == info.split(split).num_samples


def test_index_of_14m_samples_fits_in_memory():
    n = 200_000
    index = build_index(Entry("train", f"n{i % 21843:08d}_{i}", i % 21843, i % 21843, "", i * 512, 110_000)
                        for i in range(n))
    per_sample = sum(col.nbytes for col in index.values()) / n
    assert per_sample * 14_000_000 < 1.5e9, per_sample


def test_cli_writes_shards(i21k, tmp_path):
    raw, out, _ = i21k
    src = tmp_path / "raw"  # the raw data a job script deletes once its shards are written
    shutil.copytree(raw.root, src)
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / ".DS_Store").write_bytes(b"\0")  # a folder made in Finder is empty
    command = ["prepare_data.py", "imagenet21k", "--src", str(src), "--out",
               str(tmp_path / "cli"), "--shard-size", "16", "--val-count", "20", "--workers", "1"]
    proc = run_launcher(*command)
    assert proc.returncode == 0, proc.stderr
    assert "103 train in 7 shards, 20 validation in 2 shards" in proc.stderr
    assert read_info(tmp_path / "cli").splits.keys() == {"train", "validation"}
    # the job script's rerun after the raw data is gone: done, not "--src does not exist"
    shutil.rmtree(src)
    proc = run_launcher(*command)
    assert proc.returncode == 0 and "is already complete; nothing to do" in proc.stderr, \
        proc.stderr[-2000:]


def test_the_default_workers_are_the_cores_the_process_may_use():
    """A SLURM job given 1 core of the node's: not a decoding process per core of the node."""
    proc = subprocess.run([sys.executable, str(REPO / "launch/prepare_data.py"), "--help"],
                          capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert proc.returncode == 0 and "(default: 1, the cores this process may use" in \
        " ".join(proc.stdout.split()), proc.stdout


def test_a_synset_tar_cut_between_two_images_is_warned_about(i21k, tmp_path):
    """A download cut off exactly where a member starts lists as a shorter, valid tar."""
    raw, _, _ = i21k
    cut = tmp_path / "cut"
    shutil.copytree(raw.root, cut)
    tar_path = cut / f"{I21K_SYNSETS[0]}.tar"
    with tarfile.open(tar_path) as tar:
        second = tar.getmembers()[1].offset  # where the second member's header starts
    tar_path.write_bytes(tar_path.read_bytes()[:second])
    proc = run_launcher("prepare_data.py", "imagenet21k", "--src", str(cut), "--out",
                        str(tmp_path / "out"), "--val-count", "0", "--workers", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{tar_path} does not end as a tar does (a download cut off?): 1 images listed " \
           f"from it; download it again if it holds more" in proc.stderr


def test_cli_bad_input_is_one_line_naming_the_fix(i21k, tmp_path):
    raw, _, _ = i21k
    proc = run_launcher("prepare_data.py", "imagenet21k", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: the following arguments are required: --src; see prepare_data.py --help"]
    bad = tmp_path / "bad"
    shutil.copytree(raw.root, bad)
    shutil.copy(bad / f"{I21K_SYNSETS[0]}.tar", bad / "n00000001.tar")
    proc = run_launcher("prepare_data.py", "imagenet21k", "--src", str(bad), "--out", str(tmp_path / "y"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: synset n00000001 (") and "pass --skip-unknown" in lines[-1]
    assert "Traceback" not in proc.stderr
    # no worker count below 1 read as 1, no output folder that is a file
    proc = run_launcher("prepare_data.py", "imagenet21k", "--src", str(raw.root), "--out",
                        str(tmp_path / "z"), "--workers", "0")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: argument --workers: expected a whole number of at least 1, got '0'; see "
        "prepare_data.py --help")
    (tmp_path / "a-file").write_text("mine")
    proc = run_launcher("prepare_data.py", "imagenet21k", "--src", str(raw.root), "--out",
                        str(tmp_path / "a-file"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: the output folder {tmp_path / 'a-file'} is a file; name a new or empty folder"]
    assert (tmp_path / "a-file").read_text() == "mine"
    # an option the source has no use for is refused, not ignored
    folder = tmp_path / "folder"
    for c in ("cat", "dog"):  # refused before any image is read
        (folder / c).mkdir(parents=True)
        (folder / c / "a.jpg").write_bytes(b"")
    proc = run_launcher("prepare_data.py", "imagefolder", "--src", str(folder), "--out",
                        str(tmp_path / "f"), "--skip-unknown")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: --skip-unknown applies to imagenet21k and imagenet1k (a fixed label list) only; "
        "drop it")
    assert not (tmp_path / "f").exists()
    # a damaged synset tar among 21k (an error page saved as the tar, a download cut off) is
    # named, in one line, whichever process read its headers
    for workers, damage in (("1", b"<html>403 Forbidden</html>\n"),
                            ("2", (raw.root / f"{I21K_SYNSETS[1]}.tar").read_bytes()[:7000])):
        broken = tmp_path / f"broken{workers}"
        shutil.copytree(raw.root, broken)
        (broken / f"{I21K_SYNSETS[1]}.tar").write_bytes(damage)
        proc = run_launcher("prepare_data.py", "imagenet21k", "--src", str(broken), "--out",
                            str(tmp_path / f"from-broken{workers}"), "--workers", workers)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: {broken / I21K_SYNSETS[1]}.tar is not a readable tar (") \
            and line.endswith(f"download it again, or move it out of --src to leave synset "
                              f"{I21K_SYNSETS[1]} out"), line
