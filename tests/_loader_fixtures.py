"""Small WebDataset shard sets in timm's layout, built from real JPEG bytes, for loader tests."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import webdataset as wds
from PIL import Image

from pretrain.data.info import DatasetInfo, SplitInfo, write_info


def jpeg_bytes(rng: np.random.Generator, size=(64, 48), quality: int = 85) -> bytes:
    w, h = size
    # A smooth gradient plus noise: compresses like a photo, not like pure noise.
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def write_split(root: Path, shard_lengths: Sequence[int], split: str = "train",
                num_classes: int = 10, seed: int = 0, size=(64, 48),
                corrupt: Dict[str, str] | None = None) -> List[str]:
    """Write shards ``toy-<split>-NNNNNN.tar`` + ``_info.json``; returns every key written.

    ``corrupt`` maps a key to "garbage" (undecodable image bytes), "empty" (0 bytes), "no_cls"
    or "bad_cls".
    """
    root.mkdir(parents=True, exist_ok=True)
    corrupt = corrupt or {}
    rng = np.random.default_rng(seed)
    keys, filenames = [], []
    for i, n in enumerate(shard_lengths):
        name = f"toy-{split}-{i:06d}.tar"
        with wds.TarWriter(str(root / name)) as sink:
            for j in range(n):
                key = f"{split}_{i:03d}_{j:03d}"
                sample = {"__key__": key, "jpg": jpeg_bytes(rng, size),
                          "cls": str(int(rng.integers(num_classes))).encode(),
                          "json": b'{"label": 0}'}
                kind = corrupt.get(key)
                if kind == "empty":
                    sample["jpg"] = b""
                elif kind == "garbage":
                    sample["jpg"] = b"\xff\xd8\xff\xe0 this is not really a jpeg" * 3
                elif kind == "no_cls":
                    del sample["cls"]
                elif kind == "bad_cls":
                    sample["cls"] = b"seven"
                sink.write(sample)
                keys.append(key)
        filenames.append(name)
    info = DatasetInfo(name="toy", splits={split: SplitInfo(split, sum(shard_lengths), filenames,
                                                           list(shard_lengths))})
    old = root / "_info.json"
    if old.exists():  # a second split in the same directory
        from pretrain.data.info import read_info
        prev = read_info(root)
        prev.splits[split] = info.splits[split]
        info = prev
    write_info(root, info)
    return keys


def truncate_inside(tar_path: Path, key: str) -> None:
    """Cut the tar file in the middle of ``key``'s image, as an interrupted copy would."""
    with tarfile.open(tar_path) as tf:
        member = next(m for m in tf.getmembers() if m.name == f"{key}.jpg")
    with open(tar_path, "r+b") as f:
        f.truncate(member.offset_data + member.size // 2)


# ---- the two-rank run, one process per rank ------------------------------------------------
# A small buffer keeps some shards fully consumed at the save point, as with real shard sizes.
LOADER_ARGS = dict(img_size=32, batch_size=4, seed=3, num_workers=2, shuffle_buffer=3)


def two_rank_main(rank: int, port: str, root: str, out: str, steps: int, save_at: int) -> None:
    """One rank: run ``steps`` steps saving the loader state at ``save_at``, then resume from
    that state in a fresh loader and run the rest again. Writes what it saw to out/rank{R}.json."""
    import json

    import torch.distributed as dist

    from pretrain.data.loader import TrainLoader
    from pretrain.data.shards import ShardSet

    from pretrain.data.remote import RetryPolicy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    # quick retries: the remote tests' servers fail on purpose, often
    shards = ShardSet.from_info(root, "train", RetryPolicy(attempts=20, backoff_s=0.01))
    loader = TrainLoader(shards, rank=rank, world_size=2,
                         log_sample_keys=str(Path(out) / "keys"), **LOADER_ARGS)
    it = iter(loader)
    seen, state = [], None
    for step in range(steps):
        if step == save_at:
            state = loader.state_dict()
        b = next(it)
        seen.append(dict(keys=b.keys, epochs=b.epochs.tolist(), pixels=int(b.images.sum())))
    del it
    resumed_loader = TrainLoader(shards, rank=rank, world_size=2, **LOADER_ARGS)
    resumed_loader.load_state_dict(json.loads(json.dumps(state)))
    it = iter(resumed_loader)
    resumed = []
    for _ in range(steps - save_at):
        b = next(it)
        resumed.append(dict(keys=b.keys, epochs=b.epochs.tolist(), pixels=int(b.images.sum())))
    del it
    Path(out, f"rank{rank}.json").write_text(json.dumps(dict(seen=seen, resumed=resumed,
                                                             state=state)))
    dist.destroy_process_group()
    # torch 2.14's gloo sometimes aborts a process as the interpreter tears down ("terminate
    # called without an active exception"), after its work is done
    import os
    os._exit(0)


def run_two_ranks(root: str, out: Path, steps: int, save_at: int, env: dict | None = None
                  ) -> List[dict]:
    """:func:`two_rank_main` on two plain processes, as a launcher starts them
    (torch.multiprocessing.spawn would make the data-loader workers spawn too, re-importing
    torch for each); returns what each rank wrote."""
    import json
    import os
    import subprocess
    import sys

    from conftest import free_port

    tests_dir = Path(__file__).parent
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(
        [str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]))
    code = ("import sys; from _loader_fixtures import two_rank_main; "
            "two_rank_main(int(sys.argv[1]), *sys.argv[2:5], int(sys.argv[5]), int(sys.argv[6]))")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(port), str(root),
                               str(out), str(steps), str(save_at)], env=env)
             for rank in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
