"""Moving bytes between ranks over the current process group (gloo or NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _device(group: dist.ProcessGroup) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def send_bytes(data: bytes, dst: int, group: dist.ProcessGroup) -> None:
    dev = _device(group)
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=dev), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev), dst, group=group)


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


def all_gather_bytes(data: bytes, group: dist.ProcessGroup) -> list[bytes]:
    """Every rank's bytes, in rank order (two collectives: lengths, then padded payloads)."""
    return all_gather_flagged(data, 0, group)[0]


def all_max(flag: int, group: dist.ProcessGroup) -> int:
    """The largest of every rank's `flag` (one small all-reduce)."""
    t = torch.tensor([flag], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def all_gather_flagged(data: bytes, flag: int, group: dist.ProcessGroup) -> tuple[list[bytes], int]:
    """`all_gather_bytes`, and the largest of every rank's `flag` at no extra collective (it rides
    with the lengths): how the commit point learns that some rank wants the job to stop."""
    dev = _device(group)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(2, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data), flag], dtype=torch.int64, device=dev), group=group)
    lengths = [int(s[0].item()) for s in sizes]
    top = max(int(s[1].item()) for s in sizes)
    width = max(lengths)
    mine = torch.zeros(width, dtype=torch.uint8, device=dev)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    parts = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, lengths)], top
