"""In-memory copies of a sharded job's state: each rank's own part, and its ward's (the buddy copy).

At a snapshot step every rank copies its part to host memory (the only work the step waits for:
a CPU clone, or on CUDA copies into pinned buffers on a side stream, overlapped with the next
step's compute), then a background thread packs it, keeps it as this rank's own copy, and swaps
copies around a ring over a process group of its own: it sends its part to its buddy and receives
its ward's (meshspec.py). A copy counts once it is whole; each rank keeps the last `keep` of each,
so when a rank dies mid-exchange the previous round is still everywhere.

The cadence adapts (the 3% rule): after each round every rank proposes the number of steps
between snapshots that keeps their cost (the step's wait plus the thread's work: the least of its
last rounds, not counting a generation's first) within `budget` of the steps' time, and the ranks
take the largest proposal at the next snapshot step (one small all-reduce there), so every rank
snapshots at the same steps.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...checkpoint.blob import pack_flat
from ...checkpoint.codec import flatten_state
from ...errors import CollectiveFailed
from ...worker.collectives import internal

log = logging.getLogger("trainguard.buddy")

BUDGET = 0.03  # snapshots may cost at most this share of the training time
MAX_EVERY = 1000
RECENT = 3  # rounds whose time the cadence looks at


@dataclass
class Copies:
    """Packed copies by (shard, step): this rank's own shard's and its ward's. Thread-safe."""

    keep: int = 2
    _by: dict[tuple[int, int], bytes] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, shard: int, step: int, data: bytes) -> None:
        with self._lock:
            self._by[(shard, step)] = data
            for old in sorted(s for g, s in self._by if g == shard)[:-self.keep]:
                del self._by[(shard, old)]

    def get(self, shard: int, step: int) -> bytes | None:
        with self._lock:
            return self._by.get((shard, step))

    def held(self) -> dict[str, list[int]]:
        with self._lock:
            out: dict[str, list[int]] = {}
            for g, s in sorted(self._by):
                out.setdefault(str(g), []).append(s)
            return out


class HostCopy:
    """A part's tensors on the host: CPU tensors cloned; CUDA ones copied into pinned buffers on a side
    stream (reused between snapshots), ready once the returned event has completed. The tensors are
    updated in place by the next optimizer step, so `fence()` (the optimizer's step pre-hook) makes
    the compute stream wait for the copy on the device: forward and backward overlap it, the host
    never waits."""

    def __init__(self):
        self._pinned: dict[str, torch.Tensor] = {}
        self._stream = None
        self._done = None  # the event of a copy the next in-place update must wait for

    @property
    def on_device(self) -> bool:
        """The part lives on a GPU: the exchange thread's work then runs on host cores the training leaves idle."""
        return self._stream is not None

    def fence(self) -> None:
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
            self._done = None

    def take(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], object]:
        if not any(t.is_cuda for t in tensors.values()):
            return {k: t.clone(memory_format=torch.contiguous_format) for k, t in tensors.items()}, None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        out = {}
        with torch.cuda.stream(self._stream):
            for k, t in tensors.items():
                if not t.is_cuda:
                    out[k] = t.clone(memory_format=torch.contiguous_format)
                    continue
                buf = self._pinned.get(k)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = self._pinned[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                t.record_stream(self._stream)
                out[k] = buf
            done = torch.cuda.Event()
            done.record(self._stream)
        self._done = done
        return out, done


class Exchange:
    """One generation's background thread: pack own copies, swap them with buddy and ward."""

    def __init__(self, copies: Copies, group: dist.ProcessGroup | None, shard: int, buddy: int | None,
                 ward: int | None, ward_shard: int | None):
        self.copies, self.group, self.shard = copies, group, shard
        self.buddy, self.ward, self.ward_shard = buddy, ward, ward_shard
        self._jobs: queue.Queue = queue.Queue()
        self.busy = False
        self.broken = ""
        self._rounds = 0
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT)  # the thread's time per round
        self._thread = threading.Thread(target=self._run, name="trainguard-buddy", daemon=True)
        self._thread.start()

    @property
    def work_s(self) -> float | None:
        """The thread's time for a round: the least of the last few, the generation's first left out (it pays
        for its first sends on a new group, while the ranks are still busy with the restore). None: not known
        yet. The least, because one slow round (the machine busy for a moment) would space the copies for long."""
        return min(self._recent) if self._recent else None

    def submit(self, step: int, tensors: dict[str, torch.Tensor], meta: dict, ready) -> None:
        self.busy = True
        self._jobs.put((step, tensors, meta, ready))

    def close(self, timeout: float = 5.0) -> bool:
        """Ask the thread to end and wait up to `timeout` s; True once it has ended (it may be called again)."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            step, tensors, meta, ready = job
            t0 = time.monotonic()
            try:
                if ready is not None:
                    ready.synchronize()
                data = pack_flat(tensors, meta)
                self.copies.put(self.shard, step, data)
                if self.buddy is not None and self.group is not None:
                    got = _swap(data, self.buddy, self.ward, self.group)
                    self.copies.put(self.ward_shard, step, got)
            except (RuntimeError, CollectiveFailed) as exc:  # the group broke (a peer died, or we left it): this
                # round is lost
                self.broken = str(exc)[:300]
                log.info("the in-memory copy of step %d was not exchanged: %s", step, self.broken)
                return
            finally:
                if self._rounds:
                    self._recent.append(time.monotonic() - t0)
                self._rounds += 1
                self.busy = False


def _swap(data: bytes, dst: int, src: int, group: dist.ProcessGroup) -> bytes:
    """Send `data` to `dst` and receive `src`'s at once (a ring: everyone sends and receives). trainguard's own
    point-to-point calls: no fault injection counts them, and they are not the script's (worker/prologue.py)."""
    with internal():
        return _swap_bytes(data, dst, src, group)


def _swap_bytes(data: bytes, dst: int, src: int, group: dist.ProcessGroup) -> bytes:
    n_out = torch.tensor([len(data)], dtype=torch.int64)
    n_in = torch.zeros(1, dtype=torch.int64)
    gdst, gsrc = dist.get_global_rank(group, dst), dist.get_global_rank(group, src)
    for w in [dist.isend(n_out, gdst, group=group), dist.irecv(n_in, gsrc, group=group)]:
        w.wait()
    out = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = torch.empty(int(n_in.item()), dtype=torch.uint8)
    for w in [dist.isend(out, gdst, group=group), dist.irecv(buf, gsrc, group=group)]:
        w.wait()
    return buf.numpy().tobytes()


def flat_part(part: dict, extra: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A part (shardstate.capture, live tensors) flattened without copying, for HostCopy.take."""
    return flatten_state({"part": part, **extra}, copy=False)


def propose_every(wait_s: float, work_s: float, step_s: float, budget: float = BUDGET) -> int:
    """Steps between snapshots so that (step's wait + thread's work) <= budget x the steps' time (pure)."""
    if step_s <= 0:
        return 10
    return max(1, min(MAX_EVERY, math.ceil((wait_s + work_s) / (budget * step_s))))
