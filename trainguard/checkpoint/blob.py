"""A training state as one self-describing byte string (for peers and replicas), pickle-free.

    | 4 bytes: meta length | 8 bytes: tensor length | meta (JSON) | tensors (safetensors) |
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file

from ..errors import CheckpointCorrupt
from .. import durable
from .codec import flatten_state, unflatten_state

_HEAD = struct.Struct(">IQ")


def pack(obj) -> bytes:
    return pack_flat(*flatten_state(obj, copy=True))


def pack_flat(tensors: dict, meta: dict) -> bytes:
    """Pack an already flattened state (see codec.flatten_state)."""
    head = json.dumps(meta, allow_nan=False).encode()
    body = st_save(tensors) if tensors else b""
    return _HEAD.pack(len(head), len(body)) + head + body


def unpack(data: bytes, what: str = "state blob"):
    if len(data) < _HEAD.size:
        raise CheckpointCorrupt(f"{what}: {len(data)} bytes is shorter than its header")
    n_meta, n_body = _HEAD.unpack_from(data)
    if _HEAD.size + n_meta + n_body != len(data):
        raise CheckpointCorrupt(f"{what}: lengths {n_meta}+{n_body} do not match {len(data)} bytes")
    try:
        meta = json.loads(data[_HEAD.size:_HEAD.size + n_meta])
        body = data[_HEAD.size + n_meta:]
        tensors = st_load(bytes(body)) if n_body else {}
    except (ValueError, RuntimeError) as exc:  # json / safetensors parse errors
        raise CheckpointCorrupt(f"{what}: {exc}") from None
    return unflatten_state(tensors, meta, copy=False)


def save_state(path, obj) -> None:
    """Write any training state to one safetensors file (structure in its metadata), atomically."""
    tensors, meta = flatten_state(obj, copy=True)
    with durable.replacing(Path(path)) as tmp:
        save_file(tensors, str(tmp), metadata={"trainguard_meta": json.dumps(meta, allow_nan=False)})


def load_state(path):
    """Read a file written by save_state; never unpickles."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["trainguard_meta"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (KeyError, ValueError, OSError, RuntimeError) as exc:
        raise CheckpointCorrupt(f"{path}: not a trainguard state file ({exc})") from None
    return unflatten_state(tensors, meta, copy=False)
