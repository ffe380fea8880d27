"""Moving bytes and small values between ranks over the current process group (gloo or NCCL).

Every function here is a collective trainguard issues itself, so a failure comes out typed:
`CollectiveFailed`, with torch's error as its cause.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..errors import CollectiveFailed
from .collectives import internal


def _typed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with internal():
                return fn(*args, **kwargs)
        except RuntimeError as exc:  # gloo and NCCL report a lost peer as a RuntimeError (or a subclass)
            raise CollectiveFailed(f"{fn.__name__} failed: {exc}") from exc

    return wrapper


def _device(group: dist.ProcessGroup) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


@_typed
def send_bytes(data: bytes, dst: int, group: dist.ProcessGroup) -> None:
    dev = _device(group)
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=dev), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev), dst, group=group)


@_typed
def recv_bytes(src: int, group: dist.ProcessGroup) -> bytes:
    dev = _device(group)
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.recv(n, src, group=group)
    size = int(n.item())
    if size == 0:
        return b""
    buf = torch.empty(size, dtype=torch.uint8, device=dev)
    dist.recv(buf, src, group=group)
    return buf.cpu().numpy().tobytes()


@_typed
def all_gather_bytes(data: bytes, group: dist.ProcessGroup) -> list[bytes]:
    """Every rank's bytes, in rank order (two collectives: lengths, then padded payloads)."""
    dev = _device(group)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=dev), group=group)
    lengths = [int(s.item()) for s in sizes]
    width = max(lengths)
    mine = torch.zeros(width, dtype=torch.uint8, device=dev)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    parts = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, lengths)]


@_typed
def all_max(flag: int, group: dist.ProcessGroup) -> int:
    """The largest of every rank's `flag` (one small all-reduce)."""
    t = torch.tensor([flag], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


@_typed
def all_max_each(values: list[int], group: dist.ProcessGroup) -> list[int]:
    """The largest of every rank's value, position by position (one small all-reduce for several votes)."""
    t = torch.tensor(values, dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def gather_into():
    """torch's all-gather into one tensor, by its current name (looked up at the call: trainguard wraps the module's
    functions at init); `all_gather_into_tensor`, the name before torch 2.10, warns as deprecated since."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@_typed
def all_gather_ints(value: int, group: dist.ProcessGroup, world_size: int) -> list[int]:
    """Every rank's int64, in rank order."""
    dev = _device(group)
    out = torch.zeros(world_size, dtype=torch.int64, device=dev)
    gather_into()(out, torch.tensor([value], dtype=torch.int64, device=dev), group=group)
    return [int(v) for v in out.tolist()]


@_typed
def broadcast_int(value: int, src: int, group: dist.ProcessGroup) -> int:
    """`src`'s value on every rank."""
    t = torch.tensor([value], dtype=torch.int64, device=_device(group))
    dist.broadcast(t, src, group=group)
    return int(t.item())


@_typed
def broadcast_module(module: torch.nn.Module, src: int, group: dist.ProcessGroup) -> None:
    """Every rank takes `src`'s parameters and buffers."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src, group=group)


class FloatGather:
    """Every rank's vector (the same length on every rank), gathered by an all-gather started now and finished by
    `finish()`: a small exchange started before a step's backward travels with its gradient exchange instead of
    waiting for the other ranks on its own. On the group's device (NCCL's are CUDA); `finish()` gives it back on the
    CPU, and a failure comes out of it typed."""

    def __init__(self, mine: torch.Tensor, group: dist.ProcessGroup) -> None:
        world = dist.get_world_size(group)
        mine = mine.to(_device(group))
        self.shape = (world, mine.numel())
        self.out = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
        self.work = _start_gather(self.out, mine, group)

    @_typed
    def finish(self) -> torch.Tensor:
        """[world, n] on the CPU: row r is rank r's vector."""
        self.work.wait()
        return self.out.view(self.shape).cpu()


@_typed
def _start_gather(out: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup):
    return gather_into()(out, mine, group=group, async_op=True)
