"""Hash an engine directory's weight shards while the process is still importing torch.

A cold `LLM(DIR)` on an H200 host spends ~4 s importing torch and its CUDA libraries (one core)
before the loader starts, then 2.4 s reading, hashing and copying the 8B FP8 engine's 9.1 GB,
bound by blake2b (~0.4 GB/s a thread). `LLM` calls `start` before its first torch
import: a child process (`_hash_shards` in a fresh interpreter, no torch) hashes every shard's
8 MiB chunks on a thread pool, in the manifest digests' own chunking, while this process imports.
A process, not threads here: the importer holds this process's GIL nearly all the time, and
threads that must take it back after every read and hash would contend with it for it. The
child prints each shard's chunk digests as a JSON line when the shard is done; the shard reader
takes them (`take`, waiting if that shard is not done yet) instead of hashing again, and hashes
by itself whatever the child could not give.

The bytes are read twice (there, then by the reader), so a file changed in between would be
verified on other bytes than those loaded: the reader compares the file's identity (device,
inode, size, mtime, ctime: a write changes them) when it opens the file with the one the child
hashed under, and hashes everything itself if it differs, and again after its pass, where a
difference is an error. No torch here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kiln.checkpoint.file_hash import CHUNK_BYTES, DIGEST_BYTES

MANIFEST_FILE = "kiln_engine.json"  # kiln.checkpoint.engine_dir's (which imports torch)
_WEIGHT_INDEX_FILE = "weights.index.json"
# The importer needs a core; below this many there is none to spare for hashing beside it.
MIN_CORES = 4
# A child that has not answered for a shard by then is not waited for (the reader hashes it).
_WAIT_S = 120.0

_lock = threading.Lock()
_pending: dict[str, Future[PrehashedShard | None]] = {}  # absolute path -> its digests, to come
_children: list[subprocess.Popen] = []


def file_identity(stat: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is written or replaced."""
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@dataclass(frozen=True)
class PrehashedShard:
    """One shard's chunk digests, and the file's identity when they were made."""

    identity: tuple[int, ...]
    chunks: list[bytes]

    def digest(self, index: int) -> bytes | None:
        return self.chunks[index] if index < len(self.chunks) else None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worth_it() -> bool:
    """Whether this host has cores to hash on beside the importing one. On a 2-core CPU host,
    hashing SmolLM2's 0.54 GB beside the import made the import as much slower as the load got
    faster (~1.2 s each way): there is no idle core to take the work."""
    return usable_cores() >= MIN_CORES


def start(engine_dir: str) -> int:
    """Start hashing `engine_dir`'s weight shards (an unsharded engine: tensor_parallel_size 1)
    in a child process. Returns how many shards it was given (0: not such an engine, unreadable,
    or the child did not start: the loader then reads, hashes and reports as before)."""
    try:
        with open(os.path.join(engine_dir, MANIFEST_FILE), encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("tensor_parallel_size", 1) != 1:
            return 0
        with open(os.path.join(engine_dir, _WEIGHT_INDEX_FILE), encoding="utf-8") as f:
            shards = dict.fromkeys(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    paths = [os.path.abspath(os.path.join(engine_dir, s)) for s in shards]
    # The environment's kiln (this one, however it is installed), else the folder this one is in
    # (a script that put it on sys.path itself), appended so no stdlib module is shadowed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        f"import sys; sys.path.append({root!r}); "
        "from kiln.checkpoint.prehash import _hash_shards; "
        "_hash_shards(int(sys.argv[1]), sys.argv[2:])"
    )
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(CHUNK_BYTES), *paths],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
    except OSError:
        return 0
    futures: dict[str, Future[PrehashedShard | None]] = {p: Future() for p in paths}
    with _lock:
        _pending.update(futures)
        _children.append(child)
    threading.Thread(
        target=_collect, args=(child, futures), name="kiln-prehash", daemon=True
    ).start()
    return len(paths)


def take(path: str) -> PrehashedShard | None:
    """The digests of `path`'s chunks (waited for while the child hashes it), or None."""
    with _lock:
        future = _pending.pop(os.path.abspath(path), None)
    if future is None:
        return None
    try:
        return future.result(timeout=_WAIT_S)
    except Exception:  # timed out: the reader hashes it
        return None


def discard() -> None:
    """Forget whatever the load did not take, and stop the child if it is still hashing."""
    with _lock:
        _pending.clear()
        children = list(_children)
        _children.clear()
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


def _collect(
    child: subprocess.Popen[bytes], futures: dict[str, Future[PrehashedShard | None]]
) -> None:
    """The child's lines -> each shard's Future; a shard it never reported gets None."""
    stdout = child.stdout
    assert stdout is not None  # started with stdout=PIPE
    try:
        for line in stdout:
            try:
                entry = json.loads(line)
                shard = PrehashedShard(
                    tuple(entry["identity"]), [bytes.fromhex(c) for c in entry["chunks"]]
                )
                future = futures.get(entry["path"])
            except (ValueError, KeyError, TypeError):
                continue
            if future is not None and not future.done():
                future.set_result(shard)
    finally:
        for future in futures.values():
            if not future.done():
                future.set_result(None)
        stdout.close()


def _hash_shards(chunk_bytes: int, paths: list[str]) -> None:
    """The child: every chunk of every shard on one pool; one line per shard, in order. It
    stays off the parent's way: niced, and two cores fewer threads than the host has (the
    importer's, and one for the rest), so the import it hides behind is not slowed by it."""
    with contextlib.suppress(OSError):
        os.nice(10)
    pool = ThreadPoolExecutor(max_workers=max(1, min(32, usable_cores() - 2)))
    jobs = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        stat = os.fstat(fd)
        offsets = range(0, max(stat.st_size, 1), chunk_bytes)
        chunks = [pool.submit(_chunk_digest, fd, o, chunk_bytes) for o in offsets]
        jobs.append((path, fd, file_identity(stat), chunks))
    for path, fd, identity, chunks in jobs:
        try:
            digests = [c.result().hex() for c in chunks]
        except OSError:
            continue
        finally:
            os.close(fd)
        line = json.dumps({"path": path, "identity": identity, "chunks": digests})
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _chunk_digest(fd: int, offset: int, chunk_bytes: int) -> bytes:
    data = os.pread(fd, chunk_bytes, offset)
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()
