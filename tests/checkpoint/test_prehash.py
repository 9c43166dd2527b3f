"""Hashing an engine's shards while torch imports (kiln.checkpoint.prehash): the reader takes the
digests made there instead of hashing again, a chunk not reached yet is hashed by the reader, and
a file changed before or during the load is still refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.checkpoint import file_hash, prehash, shard_reader
from kiln.checkpoint.file_hash import hash_files
from kiln.checkpoint.shard_reader import ShardReader
from kiln.errors import ModelLoadError

CHUNK = 4096


@pytest.fixture
def engine(tmp_path, monkeypatch) -> tuple[str, str, str]:
    """(engine dir, its shard, the shard's manifest digest), small chunks so the shard spans
    several."""
    for module in (file_hash, shard_reader, prehash):
        monkeypatch.setattr(module, "CHUNK_BYTES", CHUNK)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(40, 100, generator=g), "b": torch.randn(7, 3, generator=g)}
    shard = str(tmp_path / "model.safetensors")
    save_file(tensors, shard, metadata={"format": "pt"})
    (tmp_path / "kiln_engine.json").write_text(json.dumps({"tensor_parallel_size": 1}))
    index = {"weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (tmp_path / "weights.index.json").write_text(json.dumps(index))
    yield str(tmp_path), shard, hash_files([shard])[0].blake2b
    prehash.discard()


def _read(shard: str, digest: str, device: str = "cpu") -> tuple[dict, int]:
    """The shard through the reader, and how many chunks the reader hashed itself (its own
    blake2b counted; the background pool's is another module's)."""
    real, calls = shard_reader.hashlib, []

    def blake2b(*args, **kwargs):
        calls.append(1)
        return real.blake2b(*args, **kwargs)

    shard_reader.hashlib = SimpleNamespace(blake2b=blake2b)
    try:
        reader = ShardReader(torch.device(device), {shard: digest})
        got = {name: t.cpu() for name, t in reader.tensors([shard])}
    finally:
        shard_reader.hashlib = real
    return got, len(calls)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_reader_takes_the_prehashed_digests(engine, device):
    path, shard, digest = engine
    assert prehash.start(path) == 1
    got, hashed_by_reader = _read(shard, digest, device)  # cuda: through the pinned staging
    assert hashed_by_reader == 0  # every chunk's digest came from the background pass
    want = load_file(shard)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert prehash.take(shard) is None  # taken once


def test_without_a_prehash_the_reader_hashes_every_chunk(engine, monkeypatch):
    _, shard, digest = engine
    _, hashed_by_reader = _read(shard, digest)
    assert hashed_by_reader == -(-os.path.getsize(shard) // CHUNK)


def test_chunks_the_child_did_not_give_are_hashed_by_the_reader(engine, monkeypatch):
    path, shard, digest = engine
    prehash.start(path)
    done = prehash.take(shard)
    partial = prehash.PrehashedShard(done.identity, done.chunks[:1])  # the first chunk only
    monkeypatch.setattr(prehash, "take", lambda file: partial)
    got, hashed_by_reader = _read(shard, digest)
    assert hashed_by_reader == len(done.chunks) - 1
    assert torch.equal(got["a"], load_file(shard)["a"])


def _flip_last_byte(shard: str) -> None:
    with open(shard, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # coarse clocks


def test_a_file_changed_after_it_was_hashed_is_hashed_again_and_refused(engine, monkeypatch):
    path, shard, digest = engine
    prehash.start(path)
    prehash._pending[os.path.abspath(shard)].result()  # the child hashed the good bytes
    _flip_last_byte(shard)
    with pytest.raises(ModelLoadError, match="does not match its hash"):
        _read(shard, digest)


def test_a_file_changed_before_the_prehash_is_refused(engine, monkeypatch):
    path, shard, digest = engine
    _flip_last_byte(shard)
    prehash.start(path)
    with pytest.raises(ModelLoadError, match="does not match its hash"):
        _read(shard, digest)


def test_a_file_changed_during_the_read_is_an_error(engine, monkeypatch):
    path, shard, digest = engine
    prehash.start(path)
    done = prehash.take(shard)

    class TouchedWhileRead:
        identity = done.identity

        def digest(self, index: int) -> bytes | None:
            if index == 0:  # a write lands while the reader is in the file
                st = os.stat(shard)
                os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
            return done.digest(index)

    monkeypatch.setattr(prehash, "take", lambda file: TouchedWhileRead())
    with pytest.raises(ModelLoadError, match="changed while it was loading"):
        _read(shard, digest)


def test_discard_stops_the_child_and_forgets(engine):
    path, shard, _ = engine
    assert prehash.start(path) == 1
    prehash.discard()
    assert prehash.take(shard) is None and not prehash._children


def test_not_an_engine_or_a_sharded_one_starts_nothing(engine, tmp_path):
    path, shard, _ = engine
    assert prehash.start(str(tmp_path / "missing")) == 0
    with open(os.path.join(path, "kiln_engine.json"), "w") as f:
        json.dump({"tensor_parallel_size": 2}, f)  # each rank reads its own, in its process
    assert prehash.start(path) == 0 and prehash.take(shard) is None


def test_importing_llm_imports_no_torch():
    # So LLM(DIR) can start the background hashing before torch's import begins.
    code = "import sys; from kiln import LLM, SamplingParams; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_llm_on_an_engine_directory_hashes_in_the_background(tmp_path, monkeypatch):
    from kiln import LLM, SamplingParams
    from kiln.builder.build import BuildOptions, build_engine
    from tests.conftest import build_tiny_hf_model

    src, out = str(tmp_path / "src"), str(tmp_path / "engine")
    build_tiny_hf_model("llama-gqa", src)
    build_engine(src, out, BuildOptions(), None)
    prompts, params = [[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0)
    started = []
    real_start = prehash.start
    monkeypatch.setattr(prehash, "start", lambda d: started.append(real_start(d)) or started[-1])
    monkeypatch.setattr(prehash, "worth_it", lambda: True)  # whatever this host's cores
    real, calls = shard_reader.hashlib, []
    monkeypatch.setattr(
        shard_reader,
        "hashlib",
        SimpleNamespace(blake2b=lambda *a, **k: calls.append(1) or real.blake2b(*a, **k)),
    )
    llm = LLM(out)
    assert started == [1] and calls == []  # the reader hashed nothing itself
    assert not prehash._children and not prehash._pending  # the child is gone
    # The weights are the engine's: the same greedy tokens as its source loaded directly.
    want = LLM(src).generate(prompts, params)[0].outputs[0].token_ids
    assert llm.generate(prompts, params)[0].outputs[0].token_ids == want


def test_only_with_cores_to_spare(monkeypatch):
    monkeypatch.setattr(prehash, "usable_cores", lambda: 16)
    assert prehash.worth_it()
    monkeypatch.setattr(prehash, "usable_cores", lambda: 2)  # the importer's core and one more
    assert not prehash.worth_it()
