"""The key-value data behind torch's rendezvous, kept per generation in the scheduler's memory.

Each generation has its own namespace; a request for another generation is refused by the
scheduler before it gets here. Old generations are dropped once a new one forms.
"""

from __future__ import annotations

from collections import defaultdict

from . import protocol as p


class KVStore:
    def __init__(self) -> None:
        self._data: dict[int, dict[str, bytes]] = defaultdict(dict)

    def has(self, generation: int, keys: list[str]) -> bool:
        space = self._data.get(generation, {})
        return all(k in space for k in keys)

    def keep_only(self, generation: int) -> None:
        for g in [g for g in self._data if g != generation]:
            del self._data[g]

    def apply(self, req: p.StoreOp) -> p.StoreReply:
        space = self._data[req.generation]
        op, keys = req.op, req.keys
        if op == "set":
            space[keys[0]] = req.value
            return p.StoreReply()
        if op == "get":
            return p.StoreReply(value=space[keys[0]])
        if op == "wait":
            return p.StoreReply(flag=True)
        if op == "check":
            return p.StoreReply(flag=all(k in space for k in keys))
        if op == "add":
            value = int(space.get(keys[0], b"0")) + req.amount
            space[keys[0]] = str(value).encode()
            return p.StoreReply(number=value)
        if op == "delete":
            return p.StoreReply(flag=space.pop(keys[0], None) is not None)
        if op == "compare_set":
            current = space.get(keys[0])
            if (current is None and req.expected == b"") or current == req.expected:
                space[keys[0]] = req.value
                return p.StoreReply(value=req.value)
            return p.StoreReply(value=req.expected if current is None else current)
        if op == "num_keys":
            return p.StoreReply(number=len(space))
        raise AssertionError(op)
