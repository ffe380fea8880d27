"""A pickle-free codec for training state: tensors out, everything else as JSON.

`flatten_state(obj)` splits a nesting of dicts, lists, tuples, tensors, ndarrays and
scalars into `tensors` (name -> CPU tensor, names taken from the path, e.g.
``optimizer/state/0/exp_avg``) and `meta`, a JSON-serialisable tree (``allow_nan=False``)
that records every other value and refers to the tensors by name. `unflatten_state`
inverts it exactly: same Python types, int vs str dict keys, tuples, dtypes and float bits.

Meta nodes: JSON null/bool/int/str/finite float stand for themselves; every other value is
a dict tagged by ``"t"``. No pickle, no eval, no torch.load on any path.
"""

from __future__ import annotations

import base64
import math
import struct
from collections import Counter, OrderedDict
from typing import Any, Callable

import numpy as np
import torch

from ..errors import CheckpointCorrupt, CheckpointError

CODEC_VERSION = 1
_SUPPORTED = ("dict, OrderedDict and Counter (str/int keys), list, tuple, torch.Tensor, numpy.ndarray, int, float, "
              "bool, None, str, bytes")
_MAPPINGS = {dict: "dict", OrderedDict: "odict", Counter: "counter"}  # Counter: MultiStepLR's milestones

WALLCLOCK = "wallclock"  # a key of a state whose values a clock measured: kept and restored, never compared (verify)


TensorHook = Callable[[str, torch.Tensor], torch.Tensor]


def flatten_state(obj: Any, *, copy: bool = True,
                  tensor_hook: TensorHook | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Split `obj` into (tensors, meta). With copy=True every tensor is a private, detached,
    contiguous CPU copy, so later in-place updates by the caller cannot change it.

    `tensor_hook(key, tensor)`, if given, sees every tensor with the name it will be stored
    under and returns the tensor to store instead (sharded saves use it to swap a DTensor
    for its local piece)."""
    enc = _Encoder(copy, tensor_hook)
    root = enc.node(obj, ())
    return enc.tensors, {"codec": CODEC_VERSION, "root": root}


def unflatten_state(tensors: dict[str, torch.Tensor], meta: dict, *, copy: bool = True) -> Any:
    """Rebuild the object `flatten_state` split. With copy=False the result shares memory
    with `tensors` (fine for freshly loaded files; not for a snapshot you restore twice)."""
    if not isinstance(meta, dict) or meta.get("codec") != CODEC_VERSION or "root" not in meta:
        got = meta.get("codec") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointCorrupt(f"state meta is not trainguard codec version {CODEC_VERSION} (got {got!r}); "
                                "it was written by another tool or version")
    dec = _Decoder(tensors, copy)
    obj = dec.node(meta["root"])
    unused = set(tensors) - dec.used
    if unused:
        raise CheckpointCorrupt(f"state has {len(unused)} tensors its meta does not use, e.g. "
                                f"{sorted(unused)[:3]}; the meta and tensors come from different saves")
    return obj


def state_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of tensor data (not counting headers or meta)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --- encoding ------------------------------------------------------------------------------


def _float_node(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"t": "f64", "bits": struct.pack("<d", x).hex()}  # exact, incl. the sign of nan


class _Encoder:
    def __init__(self, copy: bool, hook: TensorHook | None = None) -> None:
        self.copy = copy
        self.hook = hook
        self.tensors: dict[str, torch.Tensor] = {}
        self._open: set[int] = set()  # ids of containers on the current path (cycle check)

    def _key(self, path: tuple[str, ...]) -> str:
        base = "/".join(path) or "tensor"
        key, n = base, 0
        while key in self.tensors or key == "__metadata__":  # reserved by safetensors
            n += 1
            key = f"{base}~{n}"
        return key

    def _store(self, t: torch.Tensor, path: tuple[str, ...]) -> str:
        key = self._key(path)
        if self.hook is not None:
            t = self.hook(key, t)
        if t.layout != torch.strided:
            raise CheckpointError(f"cannot store a {t.layout} tensor at {'/'.join(path) or '<root>'}; "
                                  "convert it to a dense tensor first")
        t = t.detach().resolve_conj().resolve_neg()
        if self.copy:
            t = t.to(device="cpu", memory_format=torch.contiguous_format, copy=True)
        else:
            t = t.cpu()
        self.tensors[key] = t.contiguous()
        return key

    def node(self, x: Any, path: tuple[str, ...]) -> Any:
        kind = type(x)
        if x is None or kind in (bool, int, str):
            return x
        if kind is float:
            return _float_node(x)
        if isinstance(x, torch.Tensor):
            return {"t": "tensor", "k": self._store(x, path)}
        if kind is bytes:
            return {"t": "bytes", "v": base64.b64encode(x).decode("ascii")}
        if kind is np.ndarray:
            return self._ndarray(x, path)
        if isinstance(x, np.generic):
            dtype = self._np_dtype(x.dtype, path)
            return {"t": "npscalar", "dtype": dtype, "v": base64.b64encode(x.tobytes()).decode("ascii")}
        if kind in _MAPPINGS or kind in (list, tuple):
            if id(x) in self._open:
                raise CheckpointError(f"state has a reference cycle at {'/'.join(path) or '<root>'}")
            self._open.add(id(x))
            try:
                return self._container(x, kind, path)
            finally:
                self._open.discard(id(x))
        raise CheckpointError(f"cannot store a {kind.__module__}.{kind.__qualname__} at "
                              f"{'/'.join(path) or '<root>'}; supported: {_SUPPORTED}")

    def _container(self, x: Any, kind: type, path: tuple[str, ...]) -> dict:
        if kind in (list, tuple):
            return {"t": kind.__name__, "v": [self.node(v, path + (str(i),)) for i, v in enumerate(x)]}
        keys = []
        for k in x:
            if type(k) not in (str, int):
                raise CheckpointError(f"dict key {k!r} ({type(k).__name__}) at {'/'.join(path) or '<root>'} "
                                      "is not a str or int; only those keys can be stored")
            keys.append(k)
        out = {"t": _MAPPINGS[kind], "k": keys,
               "v": [self.node(x[k], path + (str(k),)) for k in keys]}
        extra = getattr(x, "_metadata", None)  # nn.Module.state_dict() keeps module versions here
        if kind is OrderedDict and extra is not None:
            out["m"] = self.node(extra, path + ("_metadata",))
        return out

    @staticmethod
    def _np_dtype(dtype: np.dtype, path: tuple[str, ...]) -> str:
        if dtype.hasobject or dtype.fields is not None or dtype.itemsize == 0:
            raise CheckpointError(f"cannot store numpy dtype {dtype} at {'/'.join(path) or '<root>'}; "
                                  "only plain numeric, bool, datetime and fixed-width string dtypes")
        return dtype.str

    def _ndarray(self, a: np.ndarray, path: tuple[str, ...]) -> dict:
        dtype = self._np_dtype(a.dtype, path)
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8).copy()  # always a private copy
        return {"t": "ndarray", "k": self._store(torch.from_numpy(raw), path), "dtype": dtype,
                "shape": list(a.shape)}


# --- decoding ------------------------------------------------------------------------------


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor], copy: bool) -> None:
        self.tensors = tensors
        self.copy = copy
        self.used: set[str] = set()

    def _tensor(self, key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in self.tensors:
            raise CheckpointCorrupt(f"state meta refers to tensor {key!r}, which is not stored; "
                                    "the meta and tensors come from different saves")
        self.used.add(key)
        t = self.tensors[key]
        return t.clone() if self.copy else t

    def node(self, n: Any) -> Any:
        if n is None or type(n) in (bool, int, str, float):
            return n
        if not isinstance(n, dict) or not isinstance(n.get("t"), str):
            raise CheckpointCorrupt(f"state meta has an unknown node {str(n)[:80]!r}")
        try:
            return self._tagged(n["t"], n)
        except (KeyError, TypeError, ValueError, struct.error) as exc:
            raise CheckpointCorrupt(f"state meta has a malformed {n['t']!r} node: {exc!r}") from exc

    def _tagged(self, tag: str, n: dict) -> Any:
        if tag in ("list", "tuple"):
            items = [self.node(v) for v in n["v"]]
            return items if tag == "list" else tuple(items)
        if tag in ("dict", "odict", "counter"):
            if len(n["k"]) != len(n["v"]) or any(type(k) not in (str, int) for k in n["k"]):
                raise ValueError("keys and values do not match")
            kind = next(k for k, t in _MAPPINGS.items() if t == tag)
            out = kind(dict(zip(n["k"], (self.node(v) for v in n["v"]))))  # Counter(pairs) would count them
            if "m" in n:
                out._metadata = self.node(n["m"])
            return out
        if tag == "tensor":
            return self._tensor(n["k"])
        if tag == "f64":
            return struct.unpack("<d", bytes.fromhex(n["bits"]))[0]
        if tag == "bytes":
            return base64.b64decode(n["v"], validate=True)
        if tag == "npscalar":
            return np.frombuffer(base64.b64decode(n["v"], validate=True), dtype=np.dtype(n["dtype"]))[0]
        if tag == "ndarray":
            raw = self._tensor(n["k"])
            if raw.dtype != torch.uint8 or raw.dim() != 1:
                raise ValueError(f"ndarray bytes are {raw.dtype} {tuple(raw.shape)}, not 1-d uint8")
            return raw.numpy().view(np.dtype(n["dtype"])).reshape([int(s) for s in n["shape"]])
        raise ValueError(f"unknown tag {tag!r}")
