"""``dynplugin bench checkpoint``: what the checkpoint protocol's file list costs on this machine.

A checkpoint of ``--size-mb`` in ``--files`` files is written (as a host would: into the page
cache), synced (the disk's writeback, which the protocol forces before the marker and a host that
saves with ``torch.save`` does not), then sealed as a save seals it (each file read back, hashed
and fsynced, on ``checkpoint_files.THREADS`` threads: the writeback already done, this is the
hashing), then verified as a resume verifies it, with hashes (``checkpoint.verify: hashes``, the
default) and sizes only: from the page cache, or with ``--cold`` from the disk. One rank does it all; in a run the ranks that share a disk split the files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from ..atomic import fsync_directory
from ..cli_args import count, number
from ..host.checkpoint_files import THREADS, listing, seal, verify
from ..host.exchange import describe

HELP = (
    "the checkpoint protocol's cost: sha256 while sealing a save, and a resume's verify (hashes or "
    "sizes), on a checkpoint written to this machine's disk"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size-mb", type=number(0.0), default=1024, help="the checkpoint's size, MB (default %(default)s)"
    )
    parser.add_argument("--files", type=count(1, 4096), default=8, help="files it is cut into (default %(default)s)")
    parser.add_argument(
        "--dir", default=".", help="where to write it (a temporary folder inside, removed after; default: here)"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the kernel's page cache before verifying, as a resume on a fresh node reads (needs root: "
        "writes /proc/sys/vm/drop_caches)",
    )


def run(args: argparse.Namespace) -> list[dict]:
    return [bench_checkpoint(args)]


def bench_checkpoint(args: argparse.Namespace) -> dict:
    root = tempfile.mkdtemp(prefix=".dyn-plugin-bench-checkpoint-", dir=args.dir)
    try:
        return _measure(root, int(args.size_mb * 2**20), args.files, args.cold)
    except OSError as exc:
        raise OSError(f"bench checkpoint in {args.dir}: {describe(exc)}") from None
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _drop_page_cache() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        raise PermissionError(
            f"--cold drops the page cache through /proc/sys/vm/drop_caches: {describe(exc)}; run as root"
        ) from None


def _measure(root: str, size: int, files: int, cold: bool) -> dict:
    block = os.urandom(8 << 20)
    per_file = size // files
    t0 = time.perf_counter()
    for i in range(files):
        with open(os.path.join(root, f"shard{i:03d}.pt"), "wb") as f:
            left = per_file
            while left:
                left -= f.write(block[: min(left, len(block))])
    written = time.perf_counter() - t0
    t0 = time.perf_counter()
    for path, _ in listing(root):
        fd = os.open(os.path.join(root, path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_directory(root, strict=True)
    writeback = time.perf_counter() - t0
    found = listing(root)
    t0 = time.perf_counter()
    entries = seal(root, found)
    sealed = time.perf_counter() - t0
    if cold:
        _drop_page_cache()
    t0 = time.perf_counter()
    problems = verify(root, entries, hashes=True)
    hashed = time.perf_counter() - t0
    t0 = time.perf_counter()
    problems += verify(root, entries, hashes=False)
    sized = time.perf_counter() - t0
    assert not problems, problems
    mb = per_file * files / 2**20
    return {
        "benchmark": "checkpoint",
        "size_mb": round(mb, 1),
        "files": files,
        "threads": THREADS,
        "cpus": os.cpu_count(),
        "write_s": round(written, 3),
        "writeback_s": round(writeback, 3),
        "seal_s": round(sealed, 3),
        "seal_mb_per_s": round(mb / sealed, 1),
        "verify_from": "disk" if cold else "page cache",
        "verify_hashes_s": round(hashed, 3),
        "verify_hashes_mb_per_s": round(mb / hashed, 1),
        "verify_sizes_s": round(sized, 4),
    }
