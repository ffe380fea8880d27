"""A safetensors header, read as untrusted input, and the dtypes safetensors can hold.

`check_header` validates a file's header (its length, JSON, every tensor's dtype, shape and data
span, no overlaps, string metadata) before the safetensors parser sees a byte, so a hostile or
damaged file is refused with its name and the reason. Such a refusal is a `CorruptFile`: a
CheckpointCorrupt whose message says to fall back to an earlier checkpoint, and whose `path` and
`reason` fields let a report (verify, a list of files tried) name the file without parsing text.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from pathlib import Path

import torch

from ..errors import CheckpointCorrupt, CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_DIM = 1 << 48  # no tensor dimension is larger; a bigger one in a header is a lie
FALLBACK = "fall back to an earlier checkpoint"

# safetensors dtype name -> (torch dtype, bytes per element); only dtypes safetensors reads
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    name: (getattr(torch, attr), size) for name, attr, size in [
        ("F64", "float64", 8), ("F32", "float32", 4), ("F16", "float16", 2), ("BF16", "bfloat16", 2),
        ("I64", "int64", 8), ("I32", "int32", 4), ("I16", "int16", 2), ("I8", "int8", 1),
        ("U64", "uint64", 8), ("U32", "uint32", 4), ("U16", "uint16", 2), ("U8", "uint8", 1),
        ("BOOL", "bool", 1), ("C64", "complex64", 8), ("F8_E4M3", "float8_e4m3fn", 1),
        ("F8_E5M2", "float8_e5m2", 1), ("F8_E4M3FNUZ", "float8_e4m3fnuz", 1),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz", 1),
    ] if hasattr(torch, attr)
}
DTYPE_NAMES = {dt: name for name, (dt, _) in DTYPES.items()}


class CorruptFile(CheckpointCorrupt):
    """One file of a checkpoint is damaged: `path`, `reason` (what is wrong, no advice) and
    `advice` (what to do) as fields; the message is ``{path}: {reason}; {advice}``."""

    def __init__(self, path: Path, reason: str, advice: str = FALLBACK):
        super().__init__(f"{path}: {reason}" + (f"; {advice}" if advice else ""))
        self.path, self.reason, self.advice = Path(path), reason, advice

    def __reduce__(self):
        return type(self), (self.path, self.reason, self.advice)

    @property
    def problem(self) -> str:
        """The file and what is wrong with it, for messages that list several files."""
        return f"{self.path}: {self.reason}"


def corrupt(path: Path, what: str) -> CorruptFile:
    return CorruptFile(path, what)


def read_untrusted(path: Path, limit: int, *, expect: int | None = None) -> bytes:
    """The bytes of a checkpoint file that may be hostile, checked before anything is read: opened without
    following a symbolic link and without blocking (a FIFO), it must be a regular file of at most `limit`
    bytes, exactly `expect` when given (a sparse or grown file is refused by its size, unread). Raises
    CorruptFile naming it; FileNotFoundError is left to the caller, which knows what a missing file means."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise corrupt(path, "is a symbolic link; a checkpoint's files are regular files in its folder") from None
        raise corrupt(path, f"cannot be read ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise corrupt(path, "is not a regular file (a FIFO, a device or a folder)")
        if expect is not None and st.st_size != expect:
            raise corrupt(path, f"is {st.st_size} bytes, the manifest says {expect} (truncated or overwritten)")
        if st.st_size > limit:
            raise corrupt(path, f"is {st.st_size} bytes, more than such a file may be ({limit})")
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left or os.read(fd, 1):
            raise corrupt(path, "changed size while it was read")
        return b"".join(chunks)
    except OSError as exc:
        raise corrupt(path, f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name for a torch dtype; CheckpointError if it cannot store it."""
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} cannot be stored by safetensors; supported: {', '.join(sorted(DTYPES))}")
    return DTYPE_NAMES[dtype]


def check_header(path: Path, data: bytes) -> dict:
    """Validate a safetensors header before the parser sees it; returns its string metadata."""
    if len(data) < 8:
        raise corrupt(path, f"is {len(data)} bytes, too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", data)
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise corrupt(path, f"safetensors header claims {n} bytes; the file has {len(data)} (limit "
                       f"{MAX_HEADER_BYTES})")
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise corrupt(path, f"safetensors header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise corrupt(path, "safetensors header is not a JSON object")
    body, spans = len(data) - 8 - n, []
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES:
            raise corrupt(path, f"tensor {key!r} has unknown dtype {str(spec)[:80]}")
        shape, offs = spec.get("shape"), spec.get("data_offsets")
        if not (isinstance(shape, list) and all(type(s) is int and 0 <= s < MAX_DIM for s in shape)):
            raise corrupt(path, f"tensor {key!r} has a bad shape {str(shape)[:80]}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1] <= body):
            raise corrupt(path, f"tensor {key!r} has data offsets {str(offs)[:80]} outside the {body}-byte data")
        numel = 1
        for s in shape:
            numel *= s
        if numel * DTYPES[spec["dtype"]][1] != offs[1] - offs[0]:
            raise corrupt(path, f"tensor {key!r} is {spec['dtype']} {shape} but spans {offs[1] - offs[0]} bytes")
        spans.append((offs[0], offs[1], key))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise corrupt(path, f"tensors {a!r} and {b!r} overlap in the data")
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise corrupt(path, "safetensors __metadata__ is not an object of strings")
    return metadata or {}
