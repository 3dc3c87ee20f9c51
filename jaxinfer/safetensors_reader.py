"""Reading a Hugging Face checkpoint's safetensors files one tensor at a time, in the stored dtype.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte offsets into the data that follows) and the raw little-endian data. Each tensor is read
with a plain file read into a fresh array, not through a memory map: the host then holds only
the tensor being loaded, and mapped file pages (which count as the process's resident memory
while the file is mapped) never pile up to the size of the checkpoint.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    # Pre-quantized FP8 checkpoints (compressed-tensors, fbgemm-fp8); safetensors' own numpy
    # reader refuses this dtype, the raw bytes are read and viewed as e4m3.
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    # Integer and boolean buffers: an EAGLE-3 head's draft-vocabulary maps (d2t, t2d).
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "BOOL": np.dtype(np.bool_),
}


class SafetensorsFile:
    """The header of one .safetensors file; :meth:`read` reads one tensor from disk."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (header_bytes,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_bytes))
        header.pop("__metadata__", None)
        self._entries = header
        self._data_start = 8 + header_bytes

    def names(self) -> list[str]:
        return list(self._entries)

    def read(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in DTYPES:
            raise NotImplementedError(
                f"{self.path}: tensor {name!r} has dtype {entry['dtype']}; supported: {', '.join(DTYPES)}")
        begin, end = entry["data_offsets"]
        out = np.empty(entry["shape"], DTYPES[entry["dtype"]])
        if out.nbytes != end - begin:
            raise ValueError(f"{self.path}: tensor {name!r} has {end - begin} bytes for shape {entry['shape']} "
                             f"of {entry['dtype']}")
        buffer = memoryview(out.reshape(-1).view(np.uint8))
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self._data_start + begin)
            done = 0
            while done < len(buffer):  # a read may return less than asked
                n = f.readinto(buffer[done:])
                if not n:
                    raise ValueError(f"{self.path} ends inside tensor {name!r}")
                done += n
        return out
