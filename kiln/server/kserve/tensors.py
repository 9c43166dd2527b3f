"""KServe v2 tensors <-> numpy: the datatype table, the JSON form (nested or flat `data`), the
binary forms (HTTP's binary tensor extension and gRPC's raw contents: little-endian elements, and
BYTES as 4-byte little-endian lengths each followed by the bytes), and gRPC's typed contents.

Every decoder checks what it is given against the declared datatype and shape and raises the
protocol's error naming the tensor: values are never silently cast (1.5 sent as INT32 is an error,
not 1)."""

from __future__ import annotations

import math
import struct

import numpy as np

from kiln.server.kserve.errors import invalid

# KServe datatype -> numpy dtype (little-endian, as the wire carries it). BYTES are object arrays
# of `bytes`.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
# gRPC InferTensorContents field per datatype (FP16 has none: raw contents only).
GRPC_CONTENTS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def check_datatype(name: str, datatype: str) -> np.dtype:
    dtype = DTYPES.get(datatype)
    if dtype is None:
        raise invalid(f"input '{name}': unknown datatype '{datatype}' (known: {sorted(DTYPES)})")
    return dtype


# More dimensions than any model input declares (and numpy's own limit is 64).
MAX_DIMS = 8


def num_elements(name: str, shape: list[int]) -> int:
    if len(shape) > MAX_DIMS:
        raise invalid(f"input '{name}': {len(shape)} dimensions, at most {MAX_DIMS}")
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise invalid(f"input '{name}': shape {shape} must be non-negative integers")
    return math.prod(shape)


def _flatten(name: str, data: object) -> list:
    if not isinstance(data, list):
        return [data]
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


_NONE = object()


def _first_bad(datatype: str, values: list) -> object:
    """The first value not of the datatype's kind or outside its range; _NONE if all fit."""
    dtype = DTYPES[datatype]
    if datatype == "BOOL":
        fits = lambda v: isinstance(v, bool)
    elif datatype == "BYTES":
        fits = lambda v: isinstance(v, (str, bytes))
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        fits = lambda v: (
            isinstance(v, int) and not isinstance(v, bool) and info.min <= v <= info.max
        )
    else:
        fits = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return next((v for v in values if not fits(v)), _NONE)


def from_values(name: str, datatype: str, shape: list[int], data: object) -> np.ndarray:
    """A tensor from JSON `data` (nested or flat) or from gRPC typed contents."""
    dtype = check_datatype(name, datatype)
    count = num_elements(name, shape)
    values = _flatten(name, data)
    if len(values) != count:
        raise invalid(
            f"input '{name}': {len(values)} values given for shape {shape} ({count} elements)"
        )
    bad = _first_bad(datatype, values)
    if bad is not _NONE:
        raise invalid(f"input '{name}': value {bad!r} is not a valid {datatype}")
    if datatype == "BYTES":
        values = [v.encode() if isinstance(v, str) else bytes(v) for v in values]
        arr = np.empty(count, dtype=object)
        arr[:] = values
        return arr.reshape(shape)
    return np.asarray(values, dtype=dtype).reshape(shape)


def from_raw(name: str, datatype: str, shape: list[int], raw: bytes) -> np.ndarray:
    """A tensor from its binary form (HTTP binary extension, gRPC raw_input_contents)."""
    dtype = check_datatype(name, datatype)
    count = num_elements(name, shape)
    if datatype == "BYTES":
        items, offset = [], 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                raise invalid(f"input '{name}': truncated BYTES element length")
            (size,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            if offset + size > len(raw):
                raise invalid(f"input '{name}': BYTES element runs past the end of its data")
            items.append(bytes(raw[offset : offset + size]))
            offset += size
        if len(items) != count:
            raise invalid(
                f"input '{name}': {len(items)} BYTES elements given for shape {shape} "
                f"({count} elements)"
            )
        arr = np.empty(count, dtype=object)
        arr[:] = items
        return arr.reshape(shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise invalid(
            f"input '{name}': {len(raw)} bytes of data for shape {shape} of {datatype} "
            f"(expected {expected})"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def to_raw(datatype: str, arr: np.ndarray) -> bytes:
    if datatype == "BYTES":
        parts = []
        for item in arr.reshape(-1):
            data = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(data)) + data)
        return b"".join(parts)
    return np.ascontiguousarray(arr, dtype=DTYPES[datatype]).tobytes()


def to_json_values(datatype: str, arr: np.ndarray) -> list:
    """Flat JSON values (row-major), as KServe v2 allows; floats kept finite for JSON."""
    flat = arr.reshape(-1)
    if datatype == "BYTES":
        return [b.decode("utf-8", errors="replace") if isinstance(b, bytes) else b for b in flat]
    if flat.dtype.kind == "f":
        flat = np.nan_to_num(flat.astype(np.float64), nan=0.0, neginf=-3.0e38, posinf=3.0e38)
    return flat.tolist()
