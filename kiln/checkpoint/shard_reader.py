"""Read an engine's safetensors shards onto the device in one pass, hashing the bytes as they go.

Reading an engine's weights twice (once to check every file's blake2b against the manifest, once
through safetensors into host tensors, then a copy to the GPU from pageable memory) took 11.3 s
of a 15.6 s start for an 8B FP8 engine on an H200. Here
each shard is read once, in the manifest digests' own 8 MiB chunks, on a thread pool (os.pread and
hashlib release the GIL): a thread reads a chunk, hashes it and copies its tensor bytes into one
device buffer for the shard: on CUDA through two pinned staging buffers of its own in turn,
the copy left running while the thread reads and hashes its next chunk; on the CPU straight
into the buffer. The shard's tensors are views of that buffer, and an engine's model takes them
as its parameters' storage (LlamaForCausalLM.load_fused_weights, adopt) instead of copying. A
shard whose digest differs from the manifest raises before its tensors are handed out, so a
tampered engine never reaches a forward. Where `LLM(DIR)` had the shards hashed while torch
imported (kiln.checkpoint.prehash), a chunk's digest comes from there instead of being made
again.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from kiln.checkpoint import prehash
from kiln.checkpoint.file_hash import CHUNK_BYTES, DIGEST_BYTES, tree_digest
from kiln.errors import ModelLoadError

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def read_header(fd: int, file: str) -> tuple[int, dict]:
    """(offset of the data, the header's tensor entries) of a safetensors file."""
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise ModelLoadError(f"engine file {file} is too short to be safetensors")
    (length,) = struct.unpack("<Q", raw)
    try:
        header = json.loads(os.pread(fd, length, 8))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"engine file {file} has an unreadable safetensors header: {e}") from e
    header.pop("__metadata__", None)
    return 8 + length, header


class ShardReader:
    """Reads shards to `device`; `expected` maps each file path to its manifest blake2b (None:
    do not check)."""

    def __init__(self, device: torch.device, expected: dict[str, str] | None) -> None:
        self.device, self.expected = device, expected
        self.cuda = device.type == "cuda"
        self._local = threading.local()
        self._streams: list[torch.cuda.Stream] = []  # every thread's copy stream (CUDA)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=min(32, 2 * (os.cpu_count() or 1)))

    def tensors(self, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for file in files:
                yield from self._read_shard(file)
        finally:
            self._pool.shutdown()  # its threads end, and their staging buffers with them
            if self.cuda:
                torch.cuda.empty_cache()  # the last shard's buffer: not part of the KV plan
                if hasattr(torch._C, "_host_emptyCache"):  # the pinned staging, back to the host
                    torch._C._host_emptyCache()

    def _read_shard(self, file: str) -> Iterator[tuple[str, torch.Tensor]]:
        hashed = prehash.take(file) if self.expected is not None else None
        fd = os.open(file, os.O_RDONLY)
        try:
            stat = os.fstat(fd)
            if hashed is not None and hashed.identity != prehash.file_identity(stat):
                hashed = None  # changed since it was hashed: hash what is read now
            size = stat.st_size
            data_start, header = read_header(fd, file)
            data = torch.empty(max(size - data_start, 0), dtype=torch.uint8, device=self.device)
            offsets = range(0, max(size, 1), CHUNK_BYTES)
            digests = list(
                self._pool.map(lambda o: self._chunk(fd, o, data_start, data, hashed), offsets)
            )
            if hashed is not None and hashed.identity != prehash.file_identity(os.fstat(fd)):
                raise ModelLoadError(
                    f"engine file {file} changed while it was loading (load it again)"
                )
        finally:
            os.close(fd)
        for stream in self._streams:  # the chunks' copies, still in flight: done before any use
            stream.synchronize()
        want = None if self.expected is None else self.expected.get(file)
        if want is not None and tree_digest(size, digests) != want:
            raise ModelLoadError(
                f"engine file {file} does not match its hash in the manifest "
                "(corrupt or modified: rebuild the engine)"
            )
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None or not 0 <= begin <= end <= data.numel():
                raise ModelLoadError(f"engine file {file}: tensor {name!r} has a bad entry")
            raw = data[begin:end]
            if begin % dtype.itemsize:  # safetensors aligns its tensors; a writer that did not
                raw = raw.clone()
            yield name, raw.view(dtype).view(entry["shape"])

    def _chunk(
        self,
        fd: int,
        offset: int,
        data_start: int,
        data: torch.Tensor,
        hashed: prehash.PrehashedShard | None,
    ) -> bytes:
        if not self.cuda and offset >= data_start:
            # Host memory: read straight into the shard's buffer and hash it there (no staging
            # copy; the buffer is the model's storage once the model takes its tensors).
            view = data[offset - data_start : offset - data_start + CHUNK_BYTES].numpy()
            n = os.preadv(fd, [view.data], offset)
            digest = self._hashed(hashed, offset)
            return digest or hashlib.blake2b(view[:n].data, digest_size=DIGEST_BYTES).digest()
        staging = self._staging()
        n = os.preadv(fd, [staging.numpy().data], offset)
        digest = self._hashed(hashed, offset)
        if digest is None:
            digest = hashlib.blake2b(staging.numpy()[:n].data, digest_size=DIGEST_BYTES).digest()
        begin = max(offset, data_start)  # the header's bytes are hashed, not copied
        if offset + n > begin:
            src = staging[begin - offset : n]
            dst = data[begin - data_start : offset + n - data_start]
            if self.cuda:
                stream = self._local.stream
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                # Not waited for here: this buffer's next use waits (two chunks on, by when it
                # has long finished), so a thread reads and hashes while its copy runs instead
                # of spinning in a synchronize per chunk beside the hashing threads.
                self._local.events[self._local.turn].record(stream)
            else:
                dst.copy_(src)
        return digest

    @staticmethod
    def _hashed(hashed: prehash.PrehashedShard | None, offset: int) -> bytes | None:
        """The chunk's digest made while torch imported, or None: this thread hashes it."""
        return hashed.digest(offset // CHUNK_BYTES) if hashed is not None else None

    def _staging(self) -> torch.Tensor:
        """This thread's next chunk-sized host buffer: on CUDA two pinned ones in turn (for
        asynchronous copies), the one returned free of its last copy; one pageable otherwise."""
        local = self._local
        if getattr(local, "buffers", None) is None:
            count = 2 if self.cuda else 1
            local.buffers = [
                torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=self.cuda)
                for _ in range(count)
            ]
            local.turn = 0
            if self.cuda:
                local.stream = torch.cuda.Stream(self.device)
                local.events = [torch.cuda.Event() for _ in range(count)]
                with self._lock:
                    self._streams.append(local.stream)
        else:
            local.turn = (local.turn + 1) % len(local.buffers)
        if self.cuda:
            local.events[local.turn].synchronize()  # its copy of two chunks ago (or never used)
        return local.buffers[local.turn]
