"""Raw dataset -> shuffled WebDataset shards in timm's layout, resumably and in parallel.

The steps of :func:`prepare`:

1. Check ``DIR``: output written with a different configuration is an error, never overwritten;
   a lock keeps a second run on the same ``DIR`` out while this one works.
2. Index every sample of the source as compact numpy columns (key, label, where the bytes are),
   cached in ``DIR/.prepare`` so an interrupted run does not scan the source again
   (:mod:`pretrain.data.shard_plan`, as is step 3).
3. Hold out ``val_count`` samples as ``validation`` by a seeded hash of their key (the same keys
   on every run), sort by key (so the result does not depend on scan order), then shuffle each
   split with a seeded permutation and cut it into shards of ``shard_size``.
4. Write the shards that are not complete yet, ``workers`` at a time: each goes to a temporary
   name and is renamed when complete, then recorded in a ledger. Unreadable images are skipped.
5. Write ``_skipped.json`` (the report of skipped files) and, last, ``_info.json``.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tarfile
from pathlib import Path
from typing import IO, Dict, List, Optional, Tuple

from pretrain.atomic_write import write_atomic
from pretrain.file_lock import holder, try_lock
from pretrain.helper_processes import pool_map

from .info import INFO_NAMES, PREPARE_WORK_DIR, DatasetInfo, SplitInfo, read_info, write_info
from .shard_plan import (Index, Shard, hold_out, index_entries, load_or_build_index, plan_shards,
                         sort_by_key, take_rows)
from .sources import PrepareError, Source, open_source
from .stored_image import to_jpeg

log = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 1000
DEFAULT_I21K_VAL_COUNT = 50_000
WORK_DIR = PREPARE_WORK_DIR
# A stage folder's (--stage, for a remote --out) own id, and the record of what it uploaded
# where (pretrain/data/publish.py): with the work folder, the hidden files that are no output
STAGE_ID, UPLOAD_LOG, STAGE_MARKER = ".stage_id", ".uploaded.jsonl", ".stage_marker.json"
BOOKKEEPING = (WORK_DIR, STAGE_ID, UPLOAD_LOG, STAGE_MARKER)
OS_LITTER = (".DS_Store", "Thumbs.db", "desktop.ini")  # a folder made in Finder or Explorer
CONFIG, LOCK = "config.json", "lock"  # in WORK_DIR
REPORT_NAME = "_skipped.json"


# --------------------------------------------------------------------------------------------
# Configuration and the output directory
# --------------------------------------------------------------------------------------------
def make_settings(source: str, src: str, *, name: Optional[str], shard_size: int, val_count: Optional[int],
                  max_size: Optional[int], seed: int, synsets: str, skip_unknown: bool) -> dict:
    """Everything that decides the output; stored in ``_info.json`` under ``prepare``."""
    if shard_size < 1:
        raise PrepareError(f"--shard-size must be at least 1, got {shard_size}")
    if max_size is not None and max_size < 1:
        raise PrepareError(f"--max-size must be a positive pixel count, got {max_size}")
    if val_count is not None and val_count < 0:
        raise PrepareError(f"--val-count must be 0 or more, got {val_count}")
    if seed < 0:
        raise PrepareError(f"--seed must be 0 or more, got {seed}")
    name = name or source
    if not re.fullmatch(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*", name):
        raise PrepareError(f"--name '{name}' may hold only letters, digits, '_', '.' and single '-'")
    if val_count is None:
        val_count = DEFAULT_I21K_VAL_COUNT if source == "imagenet21k" else 0
    if os.path.isfile(synsets):
        synsets = os.path.abspath(synsets)
    return dict(source=source, src=os.path.abspath(src), name=name, shard_size=shard_size,
                val_count=val_count, max_size=max_size, seed=seed, synsets=synsets, skip_unknown=skip_unknown)


def _option(key: str) -> str:
    return "SOURCE" if key == "source" else "--" + key.replace("_", "-")


def claim_out_dir(out: Path, settings: dict) -> IO:
    """Refuse a ``DIR`` holding other output, or one another run is writing; record this run's
    configuration in it. Returns the lock that keeps other runs out until this one ends."""
    work = out / WORK_DIR
    _recorded(out, settings)  # before anything is written into a folder that may not be ours
    work.mkdir(parents=True, exist_ok=True)
    lock = try_lock(work / LOCK)
    if lock is None:
        raise PrepareError(f"another prepare_data.py ({holder(work / LOCK)}) is writing "
                           f"{out}; wait for it to finish, or stop it and rerun to resume")
    try:
        recorded = _recorded(out, settings)  # again: the other run may have ended in between
        if recorded is not None and not same_settings(recorded, settings):
            # Nothing was written yet (say the first try stopped at an unknown synset): start
            # afresh, but keep the listing (hours for ImageNet-21k) where it still holds
            keep = {LOCK} | (INDEX_FILES if _same_listing(recorded, settings) else set())
            if INDEX_FILES & {p.name for p in work.iterdir()}:
                log.info("options changed since the last try (%s): %s", settings_diff(
                    recorded, settings), "its listing of the source is kept" if INDEX_FILES <= keep
                    else "the source is listed again")
            for p in work.iterdir():
                if p.name not in keep:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        if not (work / CONFIG).is_file():
            write_atomic(work / CONFIG, json.dumps(settings, indent=1))
    except BaseException:
        lock.close()  # not left to the traceback: a retry in this process would be refused
        raise
    return lock


# what the first pass (the listing of the source) leaves in WORK_DIR: shard_plan.py's index
# cache and scan state, the journal of a pass cut off, the spilled images of an outer tar
INDEX_FILES = {"index.npz", "scan.json", "scan", "spill"}


def _same_listing(recorded: dict, settings: dict) -> bool:
    """Whether the listing made under ``recorded`` holds under ``settings``: the options it
    depends on are the same (the others only plan and write the shards), or --skip-unknown was
    added (a listing that went on had met no unknown synset)."""
    def of(s):
        return {k: s.get(k) for k in ("source", "src", "synsets")}
    return same_settings(of(recorded), of(settings)) and (
        recorded.get("skip_unknown") == settings.get("skip_unknown")
        or settings.get("skip_unknown"))


def _recorded(out: Path, settings: dict, option: str = "--out") -> Optional[dict]:
    """The settings ``out`` was written with (None: a new or empty folder); refuses a folder
    holding something else, or shards written with other settings (``option``: the command
    line's name of the folder: --out, or --stage for a remote --out)."""
    work = out / WORK_DIR
    recorded = None
    if any((out / n).is_file() for n in INFO_NAMES):
        recorded = read_info(out).extra.get("prepare")
        if recorded is None:
            raise PrepareError(f"{out} holds shards not written by prepare_data; choose another {option}")
    elif (work / CONFIG).is_file():
        recorded = json.loads((work / CONFIG).read_text())
    elif out.is_dir() and (other := sorted(p.name for p in out.iterdir()
                                            if p.name not in BOOKKEEPING + OS_LITTER)):
        raise PrepareError(f"{out} is not empty ({other[0]}{', ...' if other[1:] else ''}) and "
                           f"holds no prepare_data output; choose a new or empty {option}")
    if recorded is not None and not same_settings(recorded, settings) and _shards_started(out):
        raise PrepareError(f"{out} was written with {settings_diff(recorded, settings)}; rerun "
                           f"with the same options or choose another {option}")
    return recorded


def check_stage_folder(stage: str, settings: dict) -> None:
    """A remote --out's --stage, checked as an output folder before the prefix is claimed
    (the claim writes into it): one holding a user's files is refused untouched."""
    _recorded(Path(stage), settings, "--stage")


def same_settings(recorded: dict, settings: dict, but: tuple = ()) -> bool:
    """Whether a preparation's recorded settings are these, but for the keys ``but``; --src
    counts as the same where both paths lead to one folder (a symlinked mount, a path with
    '..'), as a cluster's paths to one file system often differ."""
    def of(s: dict) -> dict:
        s = {k: v for k, v in s.items() if k not in but}
        if isinstance(s.get("src"), str):
            s["src"] = os.path.realpath(s["src"])
        return s
    return of(recorded) == of(settings)


def settings_diff(recorded: dict, settings: dict) -> str:
    """The options that differ, as the command line spells them: '--seed 0 (now 1)'."""
    diff = [k for k in sorted(set(recorded) | set(settings)) if recorded.get(k) != settings.get(k)
            and not (k == "src" and same_settings({k: recorded.get(k)}, {k: settings.get(k)}))]
    return ", ".join(f"{_option(k)} {recorded.get(k)!r} (now {settings.get(k)!r})" for k in diff)


def _shards_started(out: Path) -> bool:
    ledger = out / WORK_DIR / "shards.jsonl"  # made empty before the first shard is written
    return (ledger.is_file() and ledger.stat().st_size > 0) or any(
        p.name.endswith((".tar", ".tar.tmp")) for p in out.iterdir())


def settings_if_complete(out: str | os.PathLike, settings: dict) -> Optional[dict]:
    """The settings a finished ``out`` was prepared with, where it is what ``settings`` would
    prepare but for --src (:func:`_complete`); else None."""
    info = _complete(Path(out), settings) if Path(out).is_dir() else None
    return info.extra["prepare"] if info is not None else None


def _complete(out: Path, settings: dict) -> Optional[DatasetInfo]:
    """The info of a finished ``DIR`` whose shards are all present, else None."""
    if not (out / INFO_NAMES[0]).is_file():
        return None
    info = read_info(out)
    present = all((out / f).is_file() for s in info.splits.values() for f in s.filenames)
    # not --src: the source may have been moved, or deleted, since (not read again)
    recorded = info.extra.get("prepare")
    return info if present and isinstance(recorded, dict) and \
        same_settings(recorded, settings, but=("src",)) else None


# --------------------------------------------------------------------------------------------
# Writing one shard (runs in the worker processes)
# --------------------------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(source: Source, out: str, max_size: Optional[int]) -> None:
    _WORKER.update(source=source, out=out, max_size=max_size)



# what a file that is no image often is: what PIL says of it ("cannot identify image file")
# names neither
NOT_IMAGES = ((b"version https://git-lfs", "a Git LFS pointer, not the image (git lfs pull)"),
              (b"<", "an HTML or XML page, not an image (a failed download?)"))
HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"mif1", b"msf1", b"avif")


def _reason(e: Exception, data: bytes = b"") -> str:
    for start, what in NOT_IMAGES:
        if data.lstrip()[:len(start)] == start:
            return what
    if data[4:8] == b"ftyp" and data[8:12] in HEIF_BRANDS:
        return (f"a HEIF/AVIF image ({data[8:12].decode()}), which this PIL does not read; "
                f"convert it to JPEG")
    # PIL names the buffer it was handed ("cannot identify image file <_io.BytesIO object at
    # 0x7f...>"); the report names the file already
    text = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e))
    return f"{type(e).__name__}: {text}"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    # Fixed metadata (mtime 0, no owner) makes a shard's bytes depend on its samples only.
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o444
    tar.addfile(info, io.BytesIO(data))


def write_shard(job: Tuple[str, str, Index]) -> Tuple[str, int, list]:
    """Write one shard under a temporary name, then rename it: (file name, samples, skipped)."""
    filename, split, rows = job
    source, out, max_size = _WORKER["source"], _WORKER["out"], _WORKER["max_size"]
    final = os.path.join(out, filename)
    tmp = final + ".tmp"
    count, skipped = 0, []
    with open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in index_entries(rows):
                # An I/O error (a file gone, a failing disk) stops the run, which resumes later
                # without loss; only an image that does not decode is skipped.
                data = source.read(entry)
                try:
                    jpg, width, height = to_jpeg(data, max_size)
                # PIL raises many types (OSError, SyntaxError, struct.error...) on broken files,
                # and one broken file among millions must not stop the run: it is reported.
                except Exception as e:  # noqa: BLE001
                    skipped.append(dict(key=entry.key, split=split, shard=filename,
                                        source=source.describe(entry),
                                        error=_reason(e, data)))
                    continue
                meta = dict(label=entry.label, class_name=source.classes[entry.label],
                            width=width, height=height)
                _add(tar, entry.key + ".jpg", jpg)
                _add(tar, entry.key + ".cls", str(entry.label).encode())
                _add(tar, entry.key + ".json", json.dumps(meta).encode())
                count += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return filename, count, skipped


# --------------------------------------------------------------------------------------------
# The ledger of complete shards
# --------------------------------------------------------------------------------------------
def _read_ledger(path: Path) -> Dict[str, dict]:
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of a run killed mid-write
                continue
            done[record["file"]] = record
    return done


def _run(jobs: List[Tuple[str, str, Index]], source: Source, out: Path, max_size: Optional[int],
         workers: int, ledger: Path, progress: bool) -> None:
    from .progress import progress_bar

    total = sum(len(rows["key"]) for _, _, rows in jobs)
    bar = progress_bar(total=total, desc="write", unit="img", disable=not progress, smoothing=0.1)
    args = (source, str(out), max_size)
    with open(ledger, "a") as book:
        if workers <= 1:
            _init_worker(*args)
            results = map(write_shard, jobs)
        else:
            results = pool_map(write_shard, jobs, workers, ahead=2 * workers, ordered=False,
                               initializer=_init_worker, initargs=args)
        try:
            sizes = {filename: len(rows["key"]) for filename, _, rows in jobs}
            for filename, count, skipped in results:
                book.write(json.dumps(dict(file=filename, count=count, skipped=skipped)) + "\n")
                book.flush()
                bar.update(sizes[filename])
        finally:
            if workers > 1:
                results.close()  # now, not when the traceback goes: ends the pool's work
            bar.close()


# --------------------------------------------------------------------------------------------
# The whole pipeline
# --------------------------------------------------------------------------------------------
def prepare(source: str, src: str, out: str, *, name: Optional[str] = None,
            shard_size: int = DEFAULT_SHARD_SIZE, val_count: Optional[int] = None,
            max_size: Optional[int] = None, workers: int = 1, seed: int = 0, synsets: str = "goog",
            skip_unknown: bool = False, progress: bool = True) -> DatasetInfo:
    """Write ``src`` (a raw ``source`` layout) as shuffled shards + ``_info.json`` into ``out``.

    ``val_count`` (default 50,000 for imagenet21k, else 0) samples of a source without its own
    held-out split become ``validation``. Re-running resumes: complete shards are kept.
    """
    settings = make_settings(source, src, name=name, shard_size=shard_size, val_count=val_count,
                             max_size=max_size, seed=seed, synsets=synsets, skip_unknown=skip_unknown)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise PrepareError(f"the output folder {out_dir} is a file; name a new or empty folder")
    if out_dir.resolve().is_relative_to(Path(src).resolve()):
        # its shards and work files would be scanned as a class folder of the source
        raise PrepareError(f"the output folder {out_dir} is inside --src {src}; write it "
                           f"elsewhere")
    work = out_dir / WORK_DIR
    # before the source is opened: a job script's rerun after the raw data was deleted (1.3 TB
    # of ImageNet-21k) is still done. Read only: a finished folder may be read-only
    done_info = _complete(out_dir, settings)
    if done_info is not None:
        log.info("%s is already complete; nothing to do (the source is not read again: a "
                 "changed source needs a new output folder)", out_dir)
        return done_info
    raw = open_source(source, src, synsets=synsets, skip_unknown=skip_unknown, work_dir=str(work),
                      workers=workers)
    if raw.has_validation and settings["val_count"]:
        raise PrepareError(f"{source} brings its own held-out split; drop --val-count")
    with claim_out_dir(out_dir, settings):  # the lock: one run at a time writes out_dir
        # shards of the earlier listing that would be kept (all deleted since: none is)
        kept = any((out_dir / name).is_file() for name in _read_ledger(work / "shards.jsonl"))
        index = load_or_build_index(raw, src, work, progress, kept)
        if not (index["split"] == 0).any():
            raise PrepareError(f"no images found in {src}; check --src and SOURCE")
        if settings["val_count"]:
            hold_out(index, settings["val_count"], seed)
        elif not (index["split"] != 0).any():  # said now, not when a run looks for it
            log.warning("%s has no held-out images: the dataset gets a train split only, and a "
                        "run evaluating one stops at its start; --val-count N holds N images "
                        "out as 'validation' (or train with data.val_split=null)", src)
        index = sort_by_key(index, raw)
        shards = plan_shards(index, settings["name"], shard_size, seed)

        ledger = work / "shards.jsonl"
        done = _read_ledger(ledger)
        todo = [s for s in shards if not (s.filename in done and (out_dir / s.filename).is_file())]
        if len(todo) < len(shards):
            log.info("resuming: %d of %d shards are complete", len(shards) - len(todo), len(shards))
        jobs = [(s.filename, s.split, take_rows(index, s.rows)) for s in todo]
        _run(jobs, raw, out_dir, max_size, workers, ledger, progress)

        done = _read_ledger(ledger)
        _check_enough_read(out_dir, shards, done, ledger)
        # ImageNet-21k lists every synset of its list, prepared or not; the other layouts list
        # their own classes, an empty class folder included (its label is kept: a head of
        # fewer outputs would lose its name in exports)
        used = int(index["label"].max()) + 1
        info = _finish(out_dir, settings, raw, shards, done,
                       used if raw.name == "imagenet21k" else max(used, len(raw.classes)))
        shutil.rmtree(work / "spill", ignore_errors=True)
        (work / "index.npz").unlink(missing_ok=True)  # (scan.json stays: load_or_build_index)
        return info


def _check_enough_read(out: Path, shards: List[Shard], done: Dict[str, dict],
                       ledger: Path) -> None:
    """Refuse to call a preparation complete that lost a whole split, or most of its images:
    a dataset cloned without Git LFS, a folder of HEIC photos. Its shards are removed and the
    ledger emptied: with no shard written, the same command, rerun once the files are mended
    (a tar or a pickle rewritten, files removed), lists the source again and writes them all."""
    total, skipped, per_split = 0, [], {}
    for shard in shards:
        record = done[shard.filename]
        total += record["count"] + len(record["skipped"])
        skipped.extend(record["skipped"])
        per_split[shard.split] = per_split.get(shard.split, 0) + record["count"]
    empty = [name for name, count in per_split.items() if count == 0]
    if not skipped or (not empty and 2 * len(skipped) <= total):
        return
    reasons: Dict[str, int] = {}
    for item in skipped:
        reasons[item["error"]] = reasons.get(item["error"], 0) + 1
    common, times = max(reasons.items(), key=lambda kv: kv[1])
    write_atomic(out / REPORT_NAME, json.dumps(dict(num_skipped=len(skipped), skipped=skipped),
                                               indent=1))
    write_atomic(ledger, "")
    for shard in shards:
        (out / shard.filename).unlink(missing_ok=True)
    example = next(item["source"] for item in skipped if item["error"] == common)
    left = f" (split {', '.join(map(repr, empty))} left empty)" if empty else ""
    raise PrepareError(f"{len(skipped)} of {total} images could not be read{left}; {times} of "
                       f"them: {common} (e.g. {example}; all in {out / REPORT_NAME}); mend "
                       f"them and rerun the same command")


def _finish(out: Path, settings: dict, source: Source, shards: List[Shard],
            done: Dict[str, dict], num_labels: int) -> DatasetInfo:
    """Write the report of skipped files, then ``_info.json`` (last: its presence means complete).
    ``num_labels``: how many outputs a model's ``num_classes`` must reach."""
    splits: Dict[str, SplitInfo] = {}
    skipped = []
    for shard in shards:
        record = done[shard.filename]
        split = splits.setdefault(shard.split, SplitInfo(shard.split, 0, [], []))
        split.filenames.append(shard.filename)
        split.shard_lengths.append(record["count"])
        split.num_samples += record["count"]
        skipped.extend(record["skipped"])
    report = dict(num_skipped=len(skipped), unknown_classes=sorted(set(source.unknown)), skipped=skipped)
    write_atomic(out / REPORT_NAME, json.dumps(report, indent=1))
    info = DatasetInfo(name=settings["name"], splits=splits, classes=list(source.classes),
                       extra=dict(prepare=settings, num_skipped=len(skipped),
                                  num_labels=num_labels))
    write_info(out, info)
    counts = ", ".join(f"{s.num_samples} {s.name} in {len(s.filenames)} shards" for s in splits.values())
    unknown = report["unknown_classes"]
    left_out = f"; left out {len(unknown)} classes not in the label list (--skip-unknown: " \
        f"{', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''})" if unknown else ""
    log.info("wrote %s to %s; skipped %d unreadable files%s (listed in %s)",
             counts, out, len(skipped), left_out, REPORT_NAME)
    return info
