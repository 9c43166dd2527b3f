"""The one-pass shard reader: the same tensors as safetensors reads, the manifest's own digest,
and a changed byte refused before any tensor is handed out."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.checkpoint import file_hash
from kiln.checkpoint.file_hash import hash_files
from kiln.checkpoint.shard_reader import ShardReader
from kiln.errors import ModelLoadError


@pytest.fixture
def shard(tmp_path, monkeypatch):
    # Small chunks, so one file spans several (the header's chunk, tensors across chunk edges).
    monkeypatch.setattr(file_hash, "CHUNK_BYTES", 4096)
    monkeypatch.setattr("kiln.checkpoint.shard_reader.CHUNK_BYTES", 4096)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "odd_bytes": torch.randint(0, 255, (4099,), generator=g, dtype=torch.uint8),
        "fp8": torch.randn(33, 7, generator=g).to(torch.float8_e4m3fn),
        "bf16": torch.randn(64, 65, generator=g).to(torch.bfloat16),
        "f32": torch.randn(3, 1000, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)  # cuda: through the pinned staging buffers
def test_reads_what_safetensors_reads_and_checks_the_digest(shard, device):
    (digest,) = hash_files([shard])
    reader = ShardReader(torch.device(device), {shard: digest.blake2b})
    got = {name: t.cpu() for name, t in reader.tensors([shard])}
    want = load_file(shard)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(
            got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        )


def test_a_changed_byte_is_refused_before_any_tensor(shard):
    (digest,) = hash_files([shard])
    with open(shard, "rb") as f:
        data = bytearray(f.read())
    data[-5] ^= 1
    with open(shard, "wb") as f:
        f.write(bytes(data))
    reader = ShardReader(torch.device("cpu"), {shard: digest.blake2b})
    with pytest.raises(ModelLoadError, match="does not match its hash"):
        next(iter(reader.tensors([shard])))
