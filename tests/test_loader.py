"""The streaming loader: exactly-once epochs over a real 2-rank world, exact resume, corrupt input."""
from __future__ import annotations

import collections
import io
import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from _loader_fixtures import (LOADER_ARGS, jpeg_bytes, run_two_ranks, truncate_inside,
                              write_split)
from conftest import REPO, run_launcher
from pretrain.config import DataConfig
from pretrain.data.device_batch import build_mixup, normalize, prepare_batch
from pretrain.data.eval_loader import EvalLoader, build_eval_loader
from pretrain.data.info import DatasetInfoError
from pretrain.data.loader import TrainLoader, build_train_loader
from pretrain.data.shards import LoaderError, ShardSet
from pretrain.data.transforms import EvalTransform

SHARD_LENGTHS = [5, 7, 6, 9, 4, 8, 6, 7, 5, 9, 6, 8]  # 80 samples, 12 shards of unequal size



def _take(loader, steps):
    it = iter(loader)
    out = [next(it) for _ in range(steps)]
    del it
    return out


def _epoch_keys(batches, epoch):
    return [k for b in batches for k, e in zip(b["keys"], b["epochs"]) if e == epoch]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    keys = write_split(root, SHARD_LENGTHS)
    out = tmp_path_factory.mktemp("run")
    # 80 samples over 2 ranks x 4 per batch: 10 steps an epoch; 16 steps take every worker
    # well into epoch 1 even with one shard of imbalance between workers.
    steps, save_at = 16, 6
    ranks = run_two_ranks(str(root), out, steps, save_at)
    return dict(root=root, keys=keys, out=out, ranks=ranks, save_at=save_at)


def test_two_ranks_see_every_key_of_an_epoch_exactly_once(two_rank_run):
    epoch0 = [k for r in two_rank_run["ranks"] for k in _epoch_keys(r["seen"], 0)]
    counts = collections.Counter(epoch0)
    assert sorted(counts) == sorted(two_rank_run["keys"])
    assert set(counts.values()) == {1}
    # Both ranks took part, and the stream went on into the next epoch without a stop.
    assert all(_epoch_keys(r["seen"], 0) and _epoch_keys(r["seen"], 1)
               for r in two_rank_run["ranks"])


def test_key_log_lists_consumed_keys_in_order(two_rank_run):
    for rank, r in enumerate(two_rank_run["ranks"]):
        logged = (two_rank_run["out"] / "keys" / f"rank{rank}.txt").read_text().split("\n")[:-1]
        assert logged == [k for b in r["seen"] for k in b["keys"]]


def test_resume_mid_epoch_reproduces_the_rest_exactly(two_rank_run):
    save_at = two_rank_run["save_at"]
    for r in two_rank_run["ranks"]:
        assert r["resumed"] == r["seen"][save_at:]  # keys, epochs and augmented pixels


def test_resume_on_one_rank_loses_no_key(two_rank_run, caplog):
    ranks, save_at = two_rank_run["ranks"], two_rank_run["save_at"]
    state = ranks[0]["state"]
    assert state == ranks[1]["state"]  # the gathered state is the same on every rank
    before = {k for r in ranks for k in _epoch_keys(r["seen"][:save_at], 0)}
    assert 0 < len(before) < len(two_rank_run["keys"])
    loader = TrainLoader(ShardSet.from_info(str(two_rank_run["root"]), "train"),
                         rank=0, world_size=1, **LOADER_ARGS)
    with caplog.at_level(logging.WARNING, logger="pretrain.data.loader"):
        loader.load_state_dict(state)
    assert "different layout" in caplog.text
    after = []
    it = iter(loader)
    # Every worker's stream is in epoch order, so two consecutive batches of epoch >= 1
    # (one per worker) mean epoch 0 is done.
    recent = collections.deque(maxlen=2)
    for _ in range(40):
        b = next(it)
        after += [k for k, e in zip(b.keys, b.epochs.tolist()) if e == 0]
        recent.append(min(b.epochs.tolist()))
        if len(recent) == 2 and min(recent) >= 1:
            break
    del it
    assert min(recent) >= 1
    assert before | set(after) == set(two_rank_run["keys"])
    assert len(after) == len(set(after))
    # Repeats come only from shards that were in flight: a shard fully seen before the save
    # is not read again.
    shard_of = lambda key: key.rsplit("_", 1)[0]  # noqa: E731
    shard_keys = collections.defaultdict(set)
    for key in two_rank_run["keys"]:
        shard_keys[shard_of(key)].add(key)
    finished = {s for s, ks in shard_keys.items() if ks <= before}
    assert finished and not {shard_of(k) for k in after} & finished


def test_same_seed_same_stream_other_seed_other_order(tmp_path):
    write_split(tmp_path, SHARD_LENGTHS[:6])
    shards = ShardSet.from_info(str(tmp_path), "train")
    args = dict(LOADER_ARGS, seed=7)

    def run(**kw):
        return [(b.keys, b.images.clone()) for b in _take(TrainLoader(shards, **{**args, **kw}), 6)]

    first, second = run(), run()
    assert [k for k, _ in first] == [k for k, _ in second]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, second))
    assert [k for k, _ in run(seed=8)] != [k for k, _ in first]


def test_resume_in_process_with_workers(tmp_path):
    write_split(tmp_path, SHARD_LENGTHS[:6])
    shards = ShardSet.from_info(str(tmp_path), "train")
    loader = TrainLoader(shards, **LOADER_ARGS)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    rest = [next(it).keys for _ in range(8)]
    del it
    again = TrainLoader(shards, **LOADER_ARGS)
    again.load_state_dict(state)
    assert [b.keys for b in _take(again, 8)] == rest


def test_a_process_that_drops_a_loader_mid_epoch_still_exits(tmp_path):
    """Workers ignore SIGTERM (a scheduler's signal is the rank's to act on), so the exit path
    that ends them with SIGTERM must not be the only one: an iterator only a reference cycle
    still holds at exit used to leave the process waiting for its workers forever."""
    write_split(tmp_path, SHARD_LENGTHS[:6])
    script = (
        "import gc, sys\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]\n"
        "from _loader_fixtures import LOADER_ARGS\n"
        "from pretrain.data.loader import TrainLoader\n"
        "from pretrain.data.shards import ShardSet\n"
        "gc.disable()\n"
        f"it = iter(TrainLoader(ShardSet.from_info({str(tmp_path)!r}, 'train'), **LOADER_ARGS))\n"
        "next(it)\n"
        "cycle = [it]\n"
        "cycle.append(cycle)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_corrupt_samples_and_truncated_shard_are_skipped_and_counted(tmp_path, caplog):
    bad = {"train_000_001": "garbage", "train_001_002": "no_cls", "train_001_004": "bad_cls",
           "train_000_003": "empty"}
    keys = write_split(tmp_path, [6, 6, 6, 6], corrupt=bad)
    truncate_inside(tmp_path / "toy-train-000002.tar", "train_002_003")
    (tmp_path / "toy-train-000003.tar").unlink()  # gone (data.missing_shards=skip)
    lost = {"train_002_003", "train_002_004", "train_002_005"} | \
        {k for k in keys if k.startswith("train_003_")}
    good = set(keys) - set(bad) - lost
    loader = TrainLoader(ShardSet.from_info(str(tmp_path), "train"), img_size=32, batch_size=4,
                         num_workers=0, shuffle_buffer=5, seed=0, num_classes=10)
    with caplog.at_level(logging.WARNING, logger="pretrain.data.loader"):
        batches = _take(loader, 7)  # 12 good samples an epoch: epoch 0, epoch 1, into epoch 2
    seen = [(k, e) for b in batches for k, e in zip(b.keys, b.epochs.tolist())]
    for epoch in (0, 1):
        epoch_keys = [k for k, e in seen if e == epoch]
        assert sorted(epoch_keys) == sorted(good)
    assert loader.skipped_by_epoch[0] == loader.skipped_by_epoch[1] == 13
    assert loader.skipped >= 26
    two_epochs = {"undecodable": 2, "empty": 2, "bad_label": 4, "truncated_shard": 6,
                  "missing_shard": 12, "unreachable_shard": 0}
    assert all(loader.skipped_by_cause[c] >= n for c, n in two_epochs.items())
    assert "toy-train-000002.tar" in caplog.text and "train_000_001" in caplog.text
    assert "toy-train-000003.tar" in caplog.text and "train_000_003" in caplog.text

    # Resuming anywhere neither re-counts nor forgets a skip, and yields the same samples.
    def fresh():
        return TrainLoader(ShardSet.from_info(str(tmp_path), "train"), img_size=32,
                           batch_size=4, num_workers=0, shuffle_buffer=5, seed=0, num_classes=10)

    for cut in range(1, 7):
        first = fresh()
        head = _take(first, cut)
        second = fresh()
        second.load_state_dict(first.state_dict())
        tail = _take(second, 7 - cut)
        assert [b.keys for b in head + tail] == [b.keys for b in batches]
        assert second.skipped_by_epoch == loader.skipped_by_epoch
        assert second.skipped_by_cause == loader.skipped_by_cause


def test_fewer_shards_than_reader_slots_is_a_clear_error(tmp_path):
    write_split(tmp_path, [4, 4])
    shards = ShardSet.from_info(str(tmp_path), "train")
    with pytest.raises(LoaderError, match=r"2 shards but world size 2 x 2 workers = 4 .*"
                                          r"data.resample=true"):
        TrainLoader(shards, img_size=32, batch_size=4, rank=0, world_size=2, num_workers=2)
    with pytest.raises(LoaderError, match=r"lower data.num_workers to 1, write smaller"):
        TrainLoader(shards, img_size=32, batch_size=4, rank=0, world_size=2, num_workers=2)
    # more ranks than shards: no number of workers helps; a dev share's split by its name
    for workers in (0, 2):
        with pytest.raises(LoaderError, match=rf"^split 'train' has 2 shards but world size 3 "
                                              rf"x {max(1, workers)} workers = {3 * max(1, workers)} "
                                              rf"reader slots; write smaller shards "
                                              r"\(prepare_data.py --shard-size\), or set "):
            TrainLoader(shards.holding_out(0.5, "rest"), img_size=32, batch_size=4, rank=0,
                        world_size=3, num_workers=workers)
    resampled = TrainLoader(shards, img_size=32, batch_size=4, rank=1, world_size=2,
                            num_workers=2, resample=True, shuffle_buffer=4)
    batches = _take(resampled, 6)  # 8 samples, 24 drawn: the stream does not run dry
    assert {k for b in batches for k in b.keys} <= {f"train_{i:03d}_{j:03d}" for i in range(2)
                                                    for j in range(4)}


def test_build_from_config_gives_uint8_batches_and_normalises_on_device(tmp_path):
    write_split(tmp_path, [8, 8])
    cfg = DataConfig(root=str(tmp_path), num_workers=1, shuffle_buffer=4, normalize="imagenet")
    loader = build_train_loader(cfg, img_size=32, batch_size=4, seed=0, num_classes=10)
    (batch,) = _take(loader, 1)
    assert batch.images.dtype == torch.uint8 and batch.images.shape == (4, 3, 32, 32)
    assert batch.labels.dtype == torch.int64 and batch.labels.max() < 10

    extremes = torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 1, 2).expand(1, 3, 1, 2)
    scaled = normalize(extremes, "minus_one_one")
    assert torch.equal(scaled[0, :, 0, 0], torch.full((3,), -1.0))
    assert torch.equal(scaled[0, :, 0, 1], torch.full((3,), 1.0))
    x, y = prepare_batch(batch, "cpu", cfg.normalize)
    assert x.dtype == torch.float32 and torch.equal(y, batch.labels)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    assert torch.allclose(x, (batch.images / 255.0 - mean) / std, atol=1e-5)


def test_mixup_turns_labels_into_soft_targets(tmp_path):
    write_split(tmp_path, [8, 8])
    cfg = DataConfig(root=str(tmp_path), num_workers=0, mixup_alpha=0.8, label_smoothing=0.1)
    assert build_mixup(DataConfig(), num_classes=10) is None
    (batch,) = _take(build_train_loader(cfg, img_size=32, batch_size=4, num_classes=10), 1)
    x, y = prepare_batch(batch, "cpu", cfg.normalize, mixup=build_mixup(cfg, num_classes=10))
    assert y.shape == (4, 10) and torch.allclose(y.sum(1), torch.ones(4))
    assert x.min() >= -1 and x.max() <= 1


def test_eval_loader_covers_split_once_with_equal_batches_per_rank(tmp_path):
    keys = write_split(tmp_path, [5, 3, 7, 2, 6], split="validation")
    shards = ShardSet.from_info(str(tmp_path), "validation")
    per_rank = []
    for rank in range(2):
        loader = EvalLoader(shards, img_size=32, batch_size=4, rank=rank, world_size=2,
                            num_workers=2)
        batches = list(loader)
        assert len(batches) == len(loader)
        per_rank.append(batches)
    assert len(per_rank[0]) == len(per_rank[1])  # no rank waits for another at the end
    real = [k for bs in per_rank for b in bs for k, y in zip(b.keys, b.labels) if y >= 0]
    assert sorted(real) == sorted(keys)
    padding = [y for bs in per_rank for b in bs for k, y in zip(b.keys, b.labels) if k == ""]
    assert padding and all(y == -1 for y in padding)


def test_a_corrupt_eval_sample_is_named_at_the_first_evaluation_only(tmp_path, caplog):
    """The same samples are dropped at every evaluation of a run: said once, not every time.
    (In this process: the warnings of worker processes do not reach caplog; they get the same
    flag, pickled with the dataset.)"""
    write_split(tmp_path, [5, 4], split="validation", corrupt={"validation_001_002": "garbage"})
    loader = EvalLoader(ShardSet.from_info(str(tmp_path), "validation"), img_size=32,
                        batch_size=4, num_workers=0)
    passes = []
    for _ in range(3):
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            keys = sorted(k for b in loader for k in b.keys if k)
        passes.append((keys, caplog.text.count("skipping sample validation_001_002")))
    assert [n for _, n in passes] == [1, 0, 0]
    assert passes[0][0] == passes[1][0] == passes[2][0] and len(passes[0][0]) == 8


def test_draft_decoding_of_a_large_jpeg_keeps_the_quality(tmp_path):
    # A large, detailed photo-like image: decoding it at reduced DCT scale must give nearly
    # the pixels a full decode + high-quality resize gives.
    rng = np.random.default_rng(0)
    small = jpeg_bytes(rng, size=(200, 150))
    big = Image.open(io.BytesIO(small)).resize((1600, 1200), Image.BICUBIC)
    buf = io.BytesIO()
    big.save(buf, "JPEG", quality=92)
    out = EvalTransform(64)(buf.getvalue())
    # the full decode: shorter side to floor(64 / 0.875) = 73, then the centred 64 x 64
    full = Image.open(buf).convert("RGB").resize((97, 73), Image.BILINEAR)
    reference = np.asarray(full.crop((16, 4, 80, 68)))
    diff = np.abs(out.permute(1, 2, 0).numpy().astype(int) - reference.astype(int))
    assert out.dtype == torch.uint8 and out.shape == (3, 64, 64)
    assert diff.mean() < 3


def test_a_hashed_holdout_splits_train_into_disjoint_rest_and_dev(tmp_path):
    """Fine-tuning's dev split: carved from train by key hash, never trained on."""
    keys = write_split(tmp_path, [20, 20, 20, 20], size=(24, 24))
    data = DataConfig(root=str(tmp_path), num_workers=0, shuffle_buffer=10)
    train = build_train_loader(data, img_size=16, batch_size=4, holdout=0.25)
    it = iter(train)
    batches = [next(it) for _ in range(30)]  # 120 samples: past the end of epoch 0
    rest = [k for b in batches for k, e in zip(b.keys, b.epochs.tolist()) if e == 0]
    assert len(rest) == len(set(rest))
    dev = [k for b in build_eval_loader(data, img_size=16, batch_size=8, split="train",
                                        holdout=0.25) for k in b.keys if k]
    assert not set(rest) & set(dev)
    assert sorted(set(rest) | set(dev)) == sorted(keys)  # nothing lost between the two
    assert 8 <= len(dev) <= 32  # ~25 % of 80
    again = [k for b in build_eval_loader(data, img_size=16, batch_size=8, split="train",
                                          holdout=0.25) for k in b.keys if k]
    assert again == dev  # the same dev split every time


def test_a_dataset_with_labels_beyond_the_models_classes_is_refused_at_start(tiny_data, tmp_path):
    """tiny_data holds 8 synsets of ImageNet-21k: its ``classes`` list names all 21843 (their
    labels are those of the full list), so the labels it uses are what counts."""
    import shutil
    root = tmp_path / "shards"
    shutil.copytree(tiny_data, root)
    info = json.loads((root / "_info.json").read_text())
    assert info["num_labels"] == 8 and len(info["classes"]) == 21843
    assert ShardSet.from_info(str(root), "train", num_classes=8).num_samples == 256
    with pytest.raises(DatasetInfoError, match=r"has labels up to 7 but model.num_classes is 7: "
                                               r"set model.num_classes=8, or point data.root at"):
        ShardSet.from_info(str(root), "train", num_classes=7)
    for script in ("pretrain.py", "finetune.py"):  # --dry-run says so too
        proc = run_launcher(script, "--config", f"configs/{script[:-3]}/demo.yaml", "--dry-run",
                            f"data.root={root}", "model.num_classes=7",
                            *(["init=null"] if script == "finetune.py" else []))
        assert proc.returncode == 2 and proc.stderr.startswith(
            f"error: '{root}' has labels up to 7 but model.num_classes is 7"), proc.stderr[-2000:]

    # prepared before the count was recorded: the synset list says nothing, nothing is refused
    del info["num_labels"]
    (root / "_info.json").write_text(json.dumps(info))
    assert ShardSet.from_info(str(root), "train", num_classes=7).num_samples == 256
    # shards from elsewhere (no prepare record): their classes list is what they use
    del info["prepare"]
    (root / "_info.json").write_text(json.dumps(info))
    with pytest.raises(DatasetInfoError, match=r"lists 21843 classes \(no num_labels in its info file\) "
                       r"but model.num_classes is 8: .* add \"num_labels\": K to its info file"):
        ShardSet.from_info(str(root), "train", num_classes=8)


def test_a_pretraining_head_wider_than_the_labels_is_said_once_and_a_finetunes_refused(
        tiny_cifar, caplog):
    """A recipe's 12 outputs pointed at a 10-class folder trained without a word: two
    outputs never right, and exports naming classes the data does not have."""
    with caplog.at_level(logging.WARNING, logger="pretrain.data.loader"):
        for rank in (0, 1):
            build_train_loader(DataConfig(root=str(tiny_cifar)), img_size=16, batch_size=4,
                               rank=rank, world_size=2, num_classes=12)
        build_train_loader(DataConfig(root=str(tiny_cifar)), img_size=16, batch_size=4,
                           num_classes=10)
    assert [r.getMessage() for r in caplog.records] == [
        f"model.num_classes is 12 but '{tiny_cifar}' has 10 classes: the head's other 2 outputs "
        f"are never a right answer; set model.num_classes=10, unless its labels are part of a "
        f"larger set on purpose (a subset of ImageNet-21k)"]
    # ImageNet-21k prepared here names every synset of its list, only some of them used: the
    # head follows the list, and that is no mistake
    from pretrain.data.info import DatasetInfo
    listed = DatasetInfo("in21k", {}, classes=[f"n{i:08d}" for i in range(10)],
                         extra={"num_labels": 8})
    assert listed.wider_head("in21k", 10) is None and listed.wider_head("in21k", 11)
    with pytest.raises(DatasetInfoError, match="set model.num_classes=10$"):
        build_train_loader(DataConfig(root=str(tiny_cifar)), img_size=16, batch_size=4,
                           num_classes=12, exact_classes=True)
