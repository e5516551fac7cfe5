"""toolkit's checkpoint save path against DeepSpeed's own and against the storage library alone.

    .venv/bin/python scripts/bench_checkpoint.py                      # ~400 MB checkpoint, 3 rounds
    .venv/bin/python scripts/bench_checkpoint.py --params 20 --rounds 2     # quicker
    .venv/bin/python scripts/bench_checkpoint.py --url s3://bucket/bench     # a real bucket (AWS_* set)

One process (world size 1), one DeepSpeed engine (ZeRO-1, fp32 AdamW, an MLP of ``--params``
million parameters: the weights, and the optimizer's fp32 copy and two moments: about 16 bytes a
parameter), after one training step. Each round runs, back to back, on that same engine:

* local save: ``engine.save_checkpoint(dir)`` against ``toolkit.save_checkpoint(engine, dir)``
  (target: toolkit at most 1.10x DeepSpeed's time); toolkit flushes every file to disk before its
  commit (``fsync``), which DeepSpeed does not, so a third arm times DeepSpeed's save followed by
  the same flush of its files;
* local resume: ``engine.load_checkpoint(dir)`` against ``toolkit.load_checkpoint(engine, dir)``
  (target: at most 1.10x);
* upload: the upload phase of ``toolkit.save_checkpoint(engine, URL)`` (the time toolkit logs)
  against the storage library alone (fsspec ``put`` of the same files, the same bytes) (target:
  toolkit's rate at least 0.8x);
* download: the download phase of ``toolkit.load_checkpoint(engine, URL)`` against fsspec ``get``
  of those files (target: at least 0.8x).

Without ``--url`` the bucket is moto's S3 server on loopback (started here, in memory; what the
test suite uses): its rates are moto's, far below a real bucket's, but toolkit and the library
move the same bytes through it. Printed: medians over the rounds, the ratios, and how large a
checkpoint a 30 s SIGTERM grace holds at the measured rates (local save plus upload).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_moto() -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()  # noqa: S310 - loopback
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    return proc, endpoint


class Phases(logging.Handler):
    """The upload and download seconds that toolkit.checkpoint.remote logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        found = re.search(r"(uploaded|downloaded) .* in ([0-9.]+) s", text)
        if found:
            self.seen[found.group(1)] = float(found.group(2))


def timed(fn) -> float:  # noqa: ANN001
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def tree_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def one_round(rnd, engine, work, url, store, raw, phases, rows) -> int:
    """One round of every arm, the pairs in alternating order; returns the checkpoint's bytes."""
    import toolkit
    from toolkit._files import fsync_tree

    tag = f"step_{rnd + 1}"

    def pair(*names: str, arms: dict) -> None:
        """The arms one after the other, the order rotated from round to round."""
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            arms[name]()
            rows[name].append(time.perf_counter() - started)

    def ds_durable() -> None:  # DeepSpeed's save, then its files flushed as toolkit flushes its own
        engine.save_checkpoint(str(work / "dsf"), tag=tag)
        fsync_tree(work / "dsf" / tag)

    pair("ds_save", "tk_save", "ds_save_flushed", arms={
        "ds_save": lambda: engine.save_checkpoint(str(work / "ds"), tag=tag),
        "tk_save": lambda: toolkit.save_checkpoint(engine, work / "tk", steps_completed=rnd + 1),
        "ds_save_flushed": ds_durable})
    pair("ds_load", "tk_load", arms={"ds_load": lambda: engine.load_checkpoint(str(work / "ds"), tag=tag),
                                "tk_load": lambda: toolkit.load_checkpoint(engine, work / "tk")})
    files = tree_files(work / "tk" / tag)
    size = sum(p.stat().st_size for p in files)
    keys = [raw.key(f"{tag}/{p.relative_to(work / 'tk' / tag).as_posix()}") for p in files]
    got = work / "raw_get"
    pair("tk_remote_save", "lib_upload", arms={
        "tk_remote_save": lambda: toolkit.save_checkpoint(engine, url, steps_completed=rnd + 1, keep_last=1),
        "lib_upload": lambda: store.fs.put([str(p) for p in files], keys)})
    rows["tk_upload"].append(phases.seen.pop("uploaded"))
    pair("tk_remote_load", "lib_download", arms={
        "tk_remote_load": lambda: toolkit.load_checkpoint(engine, url),
        "lib_download": lambda: store.fs.get(keys, [str(got / Path(k).name) for k in keys])})
    rows["tk_download"].append(phases.seen.pop("downloaded"))
    for old in (got, work / "ds" / tag, work / "dsf" / tag, work / "tk" / tag):  # outside the timings
        shutil.rmtree(old, ignore_errors=True)
    store.fs.rm(keys)
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=25.0,
                        help="millions of parameters (default 25: a ~400 MB checkpoint)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default=None,
                        help="a bucket prefix to use instead of a loopback moto server")
    parser.add_argument("--grace", type=float, default=30.0)
    args = parser.parse_args()

    server = None
    if args.url is None:
        server, _ = start_moto()
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        args.url = "s3://bench/run"
    os.environ.setdefault("MASTER_PORT", "29533")
    import deepspeed
    import torch

    import toolkit
    from toolkit.checkpoint.store import open_store, parse_url

    phases = Phases()
    logging.getLogger("toolkit.checkpoint.remote").addHandler(phases)
    logging.getLogger("toolkit.checkpoint.remote").setLevel(logging.INFO)
    yardstick = timed(lambda: sum(i * i for i in range(30_000_000)))
    toolkit.init_distributed()
    width = 2048
    layers = max(1, round(args.params * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config={"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                                              "zero_optimization": {"stage": 1}})
    loss = engine(torch.randn(1, width)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    store = open_store(parse_url(args.url))
    raw = parse_url(args.url.rstrip("/") + "-raw")
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    os.environ["TOOLKIT_CACHE_DIR"] = str(work / "cache")
    rows: dict[str, list[float]] = {k: [] for k in (
        "ds_save", "ds_save_flushed", "tk_save", "ds_load", "tk_load", "tk_upload", "lib_upload",
        "tk_download", "lib_download",
        "tk_remote_save", "tk_remote_load")}
    sizes = []
    try:
        for rnd in range(args.rounds):
            sizes.append(one_round(rnd, engine, work, args.url, store, raw, phases, rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if server is not None:
            server.terminate()
            server.wait(30)
    med = {k: statistics.median(v) for k, v in rows.items()}
    mb = sizes[-1] / 2**20
    up_rate, lib_up = mb / med["tk_upload"], mb / med["lib_upload"]
    down_rate, lib_down = mb / med["tk_download"], mb / med["lib_download"]
    per_mb = med["tk_remote_save"] / mb  # seconds per MB of a save to the bucket: staging plus upload
    result = {
        "checkpoint_mb": round(mb, 1), "rounds": args.rounds, "yardstick_s": round(yardstick, 2),
        "url": args.url if server is None else "s3:// on moto's server (loopback)",
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "save_ratio": round(med["tk_save"] / med["ds_save"], 3),
        "save_ratio_flushed": round(med["tk_save"] / med["ds_save_flushed"], 3),
        "resume_ratio": round(med["tk_load"] / med["ds_load"], 3),
        "upload_mb_s": [round(up_rate, 1), round(lib_up, 1)], "upload_ratio": round(up_rate / lib_up, 3),
        "download_mb_s": [round(down_rate, 1), round(lib_down, 1)],
        "download_ratio": round(down_rate / lib_down, 3),
        "grace_holds_mb": round(args.grace / per_mb),
    }
    print(f"checkpoint {mb:.0f} MB, {args.rounds} rounds, yardstick {yardstick:.2f} s, {result['url']}")
    print(f"| save (local) | DeepSpeed {med['ds_save']:.2f} s | toolkit {med['tk_save']:.2f} s | "
          f"{result['save_ratio']:.3f}x (target <= 1.10) |")
    print(f"| save (local), both flushed | DeepSpeed + fsync {med['ds_save_flushed']:.2f} s | toolkit "
          f"{med['tk_save']:.2f} s | {result['save_ratio_flushed']:.3f}x |")
    print(f"| resume (local) | DeepSpeed {med['ds_load']:.2f} s | toolkit {med['tk_load']:.2f} s | "
          f"{result['resume_ratio']:.3f}x (target <= 1.10) |")
    print(f"| upload | fsspec {lib_up:.0f} MB/s | toolkit {up_rate:.0f} MB/s | {result['upload_ratio']:.3f}x "
          "(target >= 0.8) |")
    print(f"| download | fsspec {lib_down:.0f} MB/s | toolkit {down_rate:.0f} MB/s | "
          f"{result['download_ratio']:.3f}x (target >= 0.8) |")
    print(f"remote save end to end {med['tk_remote_save']:.2f} s, remote resume "
          f"{med['tk_remote_load']:.2f} s; a {args.grace:g} s grace holds a save and upload of about "
          f"{result['grace_holds_mb']} MB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
