"""What ``launch/benchmark.py`` prints for each benchmark when ``--json`` is not given: the
result as a small table on stdout (``--json`` prints the same dict as JSON).
"""
from __future__ import annotations


def loader(result: dict) -> None:
    """``benchmark.py loader``: ours against the reference pipeline, then the decoders."""
    print(f"{'pipeline':<34}{'images/s':>10}")
    print(f"{'ours (uint8, DCT-scaled decode)':<34}{result['images_per_sec']:>10.1f}")
    print(f"{'reference (wds + torchvision)':<34}{result['reference_images_per_sec']:>10.1f}")
    print(f"{'ratio':<34}{result['ratio']:>10.2f}")
    print(f"({result['workers']} workers, {result['batches']} batches of {result['batch_size']}, "
          f"{result['img_size']} px, {result['shards']} shards; {result['decoder']})")
    bench = result.get("decoder_benchmark")
    if bench:
        print(f"\n{'decode + train transform, one core':<46}{'images/s':>10}{'|diff| vs PIL':>15}")
        for row in bench["decoders"]:
            speed = "-" if row["images_per_sec"] is None else f"{row['images_per_sec']:.1f}"
            diff = row["mean_abs_diff_vs_pil"]
            print(f"{row['decoder'] + ' ' + row['version']:<46}{speed:>10}"
                  f"{'' if diff is None else f'{diff:.3f}':>15}")
            print(f"    {row['notes']}")
        print(f"({bench['photos']} photos of {bench['photo_size']}, quality {bench['quality']}, "
              f"{bench['mean_photo_kb']} KB on average; median of {bench['rounds']} rounds of "
              f"images per CPU-second)")


def train(r: dict) -> None:
    """``benchmark.py train``: one row per figure, then the profile's breakdown if taken."""
    from pretrain.bench_records import mfu_at_median
    mfu = "relative only (no peak known)" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"
    at_median = mfu_at_median(r)
    rows = [("device", r["device"]),
            ("model", f"{r['model']} @ {r['image_size']} px"),
            ("batch per rank x ranks", f"{r['batch_per_rank']} x {r['ranks']}"
             + (f", {r['grad_accum_steps']} micro-batches per update"
                if r.get("grad_accum_steps", 1) > 1 else "")
             + (f" summed in {r['grad_sum_dtype']}" if r.get("grad_sum_dtype") else "")),
            ("ZeRO stage / precision", f"{r['zero_stage']} / {r['precision']}"
             + (" / compiled" if r["compile"] else "")
             + (f" ({r['compile_mode']})" if r.get("compile_mode") not in (None, "default")
                else "")),
            ("non-finite check", r["nonfinite_check"].replace("_", " ")),
            ("gradient checks", "one pass (deepspeed.one_pass_grad_checks)"
             if r["one_pass_grad_checks"] else "DeepSpeed's own"),
            ("images/s", f"{r['images_per_sec']:,.1f}"),
            ("TFLOP/s per device", f"{r['tflops_per_device']:.3f}"),
            ("MFU", mfu),
            ("median step", f"{r['step_time_ms_median']:.1f} ms" + (
                "" if at_median is None else f" (MFU {100 * at_median:.1f} % at it)")),
            ("data wait", f"{100 * r['data_wait_frac']:.1f} %"
             + (" (synthetic input: no loader, only the time between steps)" if r["data"] == "synthetic" else "")),
            ("peak memory (rank 0)", f"{r['peak_memory_gib']:.2f} GiB"),
            ("timed / warmup steps", f"{r['steps']} / {r['warmup_steps']}")]
    for name, value in rows:
        print(f"{name:<26}{value}")
    if "profile" in r:
        from pretrain.profile import format_breakdown
        print(format_breakdown(r["profile"], r["profile_steps"], r["profile_step_ms"]))
        print(f"trace: {r['profile_dir']}/trace_rank0.json (Perfetto, chrome://tracing)")


def overhead(r: dict) -> None:
    """``benchmark.py overhead``: our step against the plain PyTorch loop."""
    print(f"{'loop':<34}{'median step ms':>16}")
    print(f"{'ours (DeepSpeed ZeRO-' + str(r['zero_stage']) + ', ' + r['precision'] + ')':<34}"
          f"{r['deepspeed_step_ms']:>16.1f}")
    print(f"{'plain PyTorch (autocast, AdamW)':<34}{r['plain_step_ms']:>16.1f}")
    print(f"{'ratio':<34}{r['ratio']:>16.3f}")
    print(f"({r['model']} @ {r['image_size']} px, batch {r['batch']}, {r['device']}, "
          f"{r['repeats']} alternating blocks of {r['steps_per_block']} steps per side)")
