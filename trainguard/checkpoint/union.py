"""A state whose ranks hold different tensors (a pipeline's stages): saved as the union of every rank's, loaded
back by each rank for the names it holds (pure functions over the codec's meta trees, codec.py).

A pipeline stage holds its own layers, named as in the whole model (`layers.2.attn...` on the second stage
of a model whose layers were deleted per stage, as torch's tutorial builds them), and its optimizer state by
those names (train/state/shardckpt.py). The checkpoint's tensors are then the whole model's, each held by
the ranks of its stage (their group info names them), and its meta is the union of the ranks' metas: a dict
holds every key any rank has, and a value two ranks both have must be the same (the LR scheduler's state, an
optimizer group's hyperparameters). A rank loading it takes the entries of the meta whose tensors it holds
(`prune`), so one stage, a layout with other stages, or one process holding the whole model each get what is
theirs.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError


def merge(metas: list[dict], where: str) -> dict:
    """The union of codec meta trees (`{"codec": v, "root": node}`); CheckpointError naming the path where two
    ranks hold different values."""
    out = metas[0]
    for rank, meta in enumerate(metas[1:], start=1):
        if meta.get("codec") != out.get("codec"):
            raise CheckpointError(f"cannot save {where}: rank {rank} encodes its state with another codec version")
        out = {**out, "root": _merge(out["root"], meta["root"], (), where, rank)}
    return out


def _merge(a: Any, b: Any, path: tuple, where: str, rank: int) -> Any:
    if _is_dict(a) and _is_dict(b):
        keys, values = list(a["k"]), list(a["v"])
        at = {k: i for i, k in enumerate(keys)}
        for k, v in zip(b["k"], b["v"]):
            if k in at:
                values[at[k]] = _merge(values[at[k]], v, path + (str(k),), where, rank)
            else:
                keys.append(k)
                values.append(v)
        out = {**a, "k": keys, "v": values}
        if "m" in b:  # the modules' versions (nn.Module.state_dict's _metadata)
            out["m"] = _merge(a["m"], b["m"], path + ("_metadata",), where, rank) if "m" in a else b["m"]
        return out
    if a != b:
        raise CheckpointError(f"cannot save {where}: {'/'.join(path) or 'the state'} differs between rank 0's stage "
                              f"and rank {rank}'s ({_short(a)} vs {_short(b)}); the stages of a pipeline must agree "
                              "on everything but their tensors (the LR scheduler, the optimizer's groups)")
    return a


def prune(meta: dict, names: set[str]) -> dict:
    """`meta` without the entries whose tensors are all outside `names` (another stage's), so that it decodes with
    the tensors of `names` alone."""
    root = _prune(meta["root"], names)
    return {**meta, "root": root if root is not _GONE else {"t": "dict", "k": [], "v": []}}


_GONE = object()


def _prune(node: Any, names: set[str]) -> Any:
    if not isinstance(node, dict):
        return node
    if node.get("t") == "tensor":
        return node if node.get("k") in names else _GONE
    if _is_dict(node):
        kept = [(k, v) for k, v in zip(node["k"], (_prune(v, names) for v in node["v"])) if v is not _GONE]
        if not kept and node["k"] and _holds_tensors(node):
            return _GONE
        return {**node, "k": [k for k, _ in kept], "v": [v for _, v in kept]}
    if node.get("t") in ("list", "tuple"):
        values = [_prune(v, names) for v in node["v"]]
        if any(v is _GONE for v in values):
            return _GONE if all(v is _GONE for v in values) else {**node, "v": [v for v in values if v is not _GONE]}
        return {**node, "v": values}
    return node


def _holds_tensors(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("t") == "tensor":
        return True
    values = node.get("v")
    return isinstance(values, list) and any(_holds_tensors(v) for v in values)


def _is_dict(node: Any) -> bool:
    return isinstance(node, dict) and node.get("t") in ("dict", "odict")


def _short(node: Any) -> str:
    text = repr(node)
    return text if len(text) <= 80 else text[:77] + "..."
