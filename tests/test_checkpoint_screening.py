"""What DeepSpeed unpickles is screened first, at any depth (a universal checkpoint's
``zero/<param>/*.pt``), and a checkpoint's files are on disk before its ``COMPLETE.json`` is.

The universal checkpoint is written file by file with ``torch.save`` in the layout DeepSpeed's
``ds_to_universal`` writes (converting a real one needs a multi-rank DeepSpeed run: a minute,
which tests/test_pretrain.py spends on a resume from two ranks onto one). The save is a real
one, through the store, by the fine-tuning backend (Accelerate, one CPU process)."""
import errno
import os
import pickle
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from pretrain.checkpoint import Checkpoint, CheckpointError, CheckpointStore, CheckpointWriteError
from pretrain.pickle_screen import check_pickles_are_inert

PARAMS = {"backbone.cls_token": (1, 1, 8), "backbone.blocks.0.attn.qkv.weight": (24, 8),
          "backbone.blocks.0.attn.qkv.bias": (24,), "head.weight": (4, 8)}
TAMPERED = "backbone.blocks.0.attn.qkv.weight"


class _TouchesFile:
    """A pickle that runs a shell command when unpickled with ``weights_only=False``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_universal(out: Path) -> None:
    """``out`` as ``ds_to_universal`` leaves it: the model-states file, the optimizer's common
    state in ``zero/optimizer_state.pt``, and per parameter ``zero/<name>/{fp32,exp_avg,
    exp_avg_sq,step}.pt``."""
    g = torch.Generator().manual_seed(0)
    module = OrderedDict((n, torch.randn(s, generator=g)) for n, s in PARAMS.items())
    rng = np.random.default_rng(0).bit_generator.state  # plain data
    legacy = np.random.RandomState(0).get_state()  # ndarray: numpy's reconstruct globals
    out.mkdir(parents=True)
    torch.save({"module": module, "step": 4, "global_steps": 4, "np_rng": legacy, "pcg": rng,
                "ds_version": "0.0.0", "param_shapes": [{n: torch.Size(s)
                                                         for n, s in PARAMS.items()}]},
               out / "mp_rank_00_model_states.pt")
    zero = out / "zero"
    zero.mkdir()
    torch.save({"optimizer_state_dict": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999),
                                                           "weight_decay": 0.05}]}},
               zero / "optimizer_state.pt")
    for name, t in module.items():
        d = zero / name
        d.mkdir()
        torch.save({"param": t.float()}, d / "fp32.pt")
        torch.save({"param": torch.zeros_like(t)}, d / "exp_avg.pt")
        torch.save({"param": torch.ones_like(t)}, d / "exp_avg_sq.pt")
        torch.save(torch.tensor(4.0), d / "step.pt")


class _NeverLoads:
    """DeepSpeed's engine, as far as the screen is concerned: it must never be reached."""

    def load_checkpoint(self, *args, **kwargs):
        raise AssertionError("DeepSpeed's loader was reached with a tampered checkpoint")


def deepspeed_backend_on(world_size: int):
    """The real DeepSpeedBackend's load path, without starting a process group."""
    from pretrain.engine import DeepSpeedBackend

    backend = DeepSpeedBackend.__new__(DeepSpeedBackend)
    backend.world_size, backend.engine = world_size, _NeverLoads()
    backend.zero_stage, backend.precision = 1, "fp32"
    return backend


@pytest.mark.parametrize("where", ["nested", "no_suffix", "linked_dir"])
def test_a_pickle_that_runs_code_deep_in_a_universal_checkpoint_is_refused(tmp_path, where):
    root, marker = tmp_path / "checkpoints", tmp_path / "payload_ran"
    universal = root / "step_00000004_universal"
    write_universal(universal)
    check_pickles_are_inert(universal)  # a clean one passes: numpy, torch.Size, tensors
    param_dir = universal / "zero" / TAMPERED
    evil = {"param": _TouchesFile(str(marker))}
    if where == "nested":  # the case the old top-level-only screen never looked at
        bad = param_dir / "exp_avg.pt"
    elif where == "no_suffix":  # named like nothing DeepSpeed reads, and still a pickle
        bad = param_dir / "exp_avg"
    else:  # the parameter's directory is a link to one outside: DeepSpeed follows it
        elsewhere = tmp_path / "elsewhere"
        param_dir.rename(elsewhere)
        param_dir.symlink_to(elsewhere, target_is_directory=True)
        bad = param_dir / "exp_avg.pt"
    torch.save(evil, bad)

    # the world size changed (1 -> 2): DeepSpeedBackend loads the universal copy
    ckpt = Checkpoint(root / "step_00000004", 4, world_size=1, zero_stage=1)
    with pytest.raises(CheckpointError) as e:
        CheckpointStore(root).load(deepspeed_backend_on(2), ckpt)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (f"'{bad}' references Python objects ['posix.system'] that a DeepSpeed "
                   f"checkpoint of this project never holds; refusing to unpickle it (DeepSpeed's "
                   f"loader would run them): remove '{universal}' or restore it from a copy you "
                   f"trust, then run again")
    assert not marker.exists()
    # the payload is live: the unpickling DeepSpeed does would have run it
    torch.load(bad, weights_only=False)
    assert marker.exists()


def test_a_bare_pickle_in_a_checkpoint_cannot_be_screened_and_is_refused(tmp_path):
    universal, marker = tmp_path / "step_00000004_universal", tmp_path / "payload_ran"
    write_universal(universal)
    bad = universal / "zero" / TAMPERED / "exp_avg_sq.pt"
    bad.write_bytes(pickle.dumps({"param": _TouchesFile(str(marker))}))  # torch's legacy format
    with pytest.raises(CheckpointError, match=r"^'.*/exp_avg_sq\.pt' is not a readable torch "
                       r"checkpoint \(.*\); refusing to let DeepSpeed unpickle it: remove '.*' or "
                       r"restore it from a copy you trust, then run again$"):
        check_pickles_are_inert(universal)
    assert not marker.exists()


# --------------------------------------------------------------------------------------------
# On disk before COMPLETE.json
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerate_backend():
    """The fine-tuning backend, one CPU process, a tiny ViT with EMA weights, after one step
    (so the optimizer has state to save)."""
    from finetune.backend import AccelerateBackend
    from finetune.config import FinetuneConfig
    from pretrain.config_files import load_config

    cfg = load_config(FinetuneConfig, REPO / "configs/finetune/demo.yaml", [
        "init=null", "model.img_size=16", "model.depth=1", "model.embed_dim=32",
        "model.num_heads=2", "model.num_classes=4", "train.global_batch_size=2",
        "train.ema_decay=0.9"])
    backend = AccelerateBackend(cfg)
    backend.build(cfg, micro=2, accum=1, resume=None, store=None)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    backend.train_micro_batch(images, torch.tensor([0, 3]), cfg, None, last=True)
    return backend


@pytest.fixture
def disk_log(monkeypatch):
    """Every os.fsync (by the path of its file, through Linux's /proc/self/fd) and os.replace,
    in order, as they happen."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        real_replace(src, dst, **kwargs)
        events.append(("replace", os.fspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_every_file_and_directory_is_fsynced_before_the_manifest_appears(
        accelerate_backend, disk_log, monkeypatch, tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = CheckpointStore(root).save(accelerate_backend, 3, {"step": 3})
    manifest = ckpt.path / "COMPLETE.json"
    appeared = disk_log.index(("replace", str(manifest)))
    before = {path for kind, path in disk_log[:appeared] if kind == "fsync"}
    files = {str(f) for f in ckpt.path.rglob("*") if f.is_file() and f != manifest}
    dirs = {str(d) for d in ckpt.path.rglob("*") if d.is_dir()} | {str(ckpt.path), str(root)}
    # model, EMA, optimizer, RNG (Accelerate: safetensors and torch.save) and the client state
    assert {Path(f).suffix for f in files} >= {".safetensors", ".bin", ".pkl", ".pt"}
    assert files | dirs <= before, sorted((files | dirs) - before)
    assert str(manifest) + ".tmp" in before  # the manifest's own bytes, before the rename
    assert ("fsync", str(ckpt.path)) in disk_log[appeared + 1:]  # and the rename itself
    # the sizes the manifest lists come from the same walk
    assert [c.step for c in CheckpointStore(root).complete()] == [3]

    # Saving the same step again (after a rollback, say) first removes its manifest, and that
    # removal is on disk before a file is rewritten: a crash cannot bring the old one back.
    disk_log.clear()
    backend_save = accelerate_backend.save_checkpoint
    monkeypatch.setattr(accelerate_backend, "save_checkpoint", lambda *a: (
        disk_log.append(("backend writes", "")), backend_save(*a)))
    CheckpointStore(root).save(accelerate_backend, 3, {"step": 3})
    assert disk_log[:2] == [("fsync", str(ckpt.path)), ("backend writes", "")]


def test_a_failed_fsync_fails_the_save_and_leaves_no_checkpoint(
        accelerate_backend, monkeypatch, tmp_path):
    root = tmp_path / "checkpoints"
    store = CheckpointStore(root)
    store.save(accelerate_backend, 3, {"step": 3})
    real = os.fsync

    def fsync(fd):  # the disk reports the write of a shard lost (EIO), as it can at fsync time
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointWriteError, match=r"^checkpoint .*step_00000006 could not be "
                       r"written: rank 0: fsync: OSError: \[Errno 5\] Input/output error; .*"
                       r"step_00000003 is intact\."):
        store.save(accelerate_backend, 6, {"step": 6})
    assert not (root / "step_00000006").exists()
    assert [c.step for c in store.complete()] == [3]


def test_a_finetune_checkpoint_screens_what_deepspeed_would_unpickle_in_it(
        accelerate_backend, tmp_path):
    """Under an Accelerate DeepSpeed config, ``load_state`` hands ``pytorch_model/`` to
    DeepSpeed's loader (``weights_only=False``); the rest is read ``weights_only``."""
    store, marker = CheckpointStore(tmp_path / "checkpoints"), tmp_path / "payload_ran"
    ckpt = store.save(accelerate_backend, 3, {"step": 3})
    assert store.load(accelerate_backend, ckpt)["step"] == 3  # nothing to screen: loads
    bad = ckpt.path / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    bad.parent.mkdir()
    torch.save({"optimizer_state_dict": _TouchesFile(str(marker))}, bad)
    with pytest.raises(CheckpointError, match=rf"^'{bad}' references Python objects "
                       r"\['posix.system'\] .*; refusing to unpickle it"):
        store.load(accelerate_backend, ckpt)
    assert not marker.exists()
