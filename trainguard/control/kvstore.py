"""The key-value data behind torch's rendezvous, kept per generation in the scheduler's memory.

Each generation has its own namespace; a request for another generation is refused by the
scheduler before it gets here. Old generations are dropped once a new one forms.
"""

from __future__ import annotations

from collections import defaultdict

from . import protocol as p
from .msgbase import INT64_MAX


class KVStore:
    def __init__(self) -> None:
        self._data: dict[int, dict[str, bytes]] = defaultdict(dict)

    def has(self, generation: int, keys: list[str]) -> bool:
        space = self._data.get(generation, {})
        return all(k in space for k in keys)

    def keep_only(self, generation: int) -> None:
        for g in [g for g in self._data if g != generation]:
            del self._data[g]

    def apply(self, req: p.StoreOp) -> p.StoreReply | p.Error:
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
            return self._add(space, keys[0], req.amount)
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

    @staticmethod
    def _add(space: dict[str, bytes], key: str, amount: int) -> p.StoreReply | p.Error:
        """torch's Store.add: the key's value as a decimal int64, plus `amount`; anything else is refused and
        the value left as it was."""
        old = space.get(key, b"0")
        try:
            value = int(old) + amount if len(old) <= 20 else None
        except ValueError:
            value = None
        if value is None:
            return p.Error(code=p.ErrorCode.BAD_MESSAGE, message=(
                f"store add on key {key[:100]!r}: its value {old[:40]!r} is not a decimal integer; "
                "add only to keys that only add writes"))
        if not -INT64_MAX - 1 <= value <= INT64_MAX:
            return p.Error(code=p.ErrorCode.BAD_MESSAGE, message=(
                f"store add on key {key[:100]!r}: {int(old)} + {amount} leaves the int64 range "
                f"{-INT64_MAX - 1}..{INT64_MAX} of torch's Store.add; the value is unchanged"))
        space[key] = str(value).encode()
        return p.StoreReply(number=value)
