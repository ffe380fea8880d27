"""A training job's checkpoint: one shared folder, each rank writes its part, one rank commits it.

    directory/{prefix}-{epoch}_{step}/
        rank_0.safetensors ... rank_{N-1}.safetensors   each rank's shared state (model, optimizer, ...)
        manifest.json    format 3, written last: step, epoch, world size, each file's sha256,
                         every rank's own state (RNG, data position), append_info

Saves are asynchronous, so the ranks cannot meet in a collective while they write. Each rank
writes into the hidden temp folder `.{name}.tmp-{step}-{save id}`. Every rank derives the save
id from its snapshot: a hash of the step and of every rank's own state, which the snapshot's
all-gather made identical everywhere. A rank writes its file under a private name, fsyncs it,
renames it to `rank_R.safetensors`, then leaves the marker `rank_R.done.json` (sha256 and size).
The committer, which is whoever writes rank 0's part, waits (bounded) for every marker. It then
writes manifest.json, fsyncs, and renames the folder into place. A rank whose write fails leaves
`rank_R.failed.json`, and the committer gives up at once. A folder that lacks any rank never
gets a manifest, so it is never listed as complete.

The directory must be shared by every rank (one host, or a shared filesystem), as torch DCP
requires.

Loading rank R reads rank_R.safetensors, verified. Any other file that the manifest lists with
the same sha256 is a bit-identical replica (in data parallel, every rank's file is). So when
rank_R.safetensors is missing or corrupt, a replica is read instead and the file is rewritten
from it.
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import json
import logging
import threading
import time
from pathlib import Path

from ..errors import CheckpointCorrupt, CheckpointError
from . import format as fmt
from .. import durable
from .blob import unpack
from .codec import unflatten_state
from .manifest import MANIFEST, Kind, Manifest, Recovered, Verified, rank_file, read
from .pieces import PieceReader, single_reader
from .safeheader import CorruptFile, corrupt, read_untrusted

log = logging.getLogger("trainguard.checkpoint")

META_KEY = "trainguard_meta"  # the state's structure (codec meta), in each file's safetensors metadata
POLL_S = 0.05
MAX_MARKER_BYTES = 1 << 20  # a done/failed marker is a line of JSON
# (rank, step) of the part this thread is writing, for fault injection (trainguard.train.engine.faults)
WRITING: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("trainguard_writing", default=None)


def _marker(tmp: Path, rank: int, kind: str) -> Path:
    return tmp / f"rank_{rank}.{kind}.json"


def save_id(name: str, step: int, blobs: dict[int, bytes]) -> str:
    """What every rank computes alike for one save: the temp folder's tag."""
    h = hashlib.sha256(f"{name}\0{step}\0{len(blobs)}".encode())
    for r in sorted(blobs):
        h.update(hashlib.sha256(blobs[r]).digest())
    return h.hexdigest()[:16]


def temp_for(folder: Path, step: int, sid: str) -> Path:
    return fmt.temp_folder(folder, f"{step}-{sid}")


# --- writing ---------------------------------------------------------------------------------


def part_done(tmp: Path, rank: int, sid: str) -> bool:
    """`rank`'s part of this save (`sid`) is already written into `tmp` (e.g. by a regular save of
    the same step that a dying-gasp save must not rewrite under its committer)."""
    return rank in _read_markers(tmp, rank + 1, sid)[0]



def write_part(tmp: Path, rank: int, step: int, tensors: dict, meta: dict, sid: str) -> dict:
    """Write `rank`'s file of step `step` and its done marker into `tmp`. On failure leave a failed
    marker (so the committer stops waiting) and raise CheckpointError naming the file."""
    name, current = rank_file(rank), tmp
    WRITING.set((rank, step))
    for kind in ("done", "failed"):
        _marker(tmp, rank, kind).unlink(missing_ok=True)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        # write_shard fsyncs the file; writing the done marker below fsyncs the folder
        with durable.replacing(tmp / name, fsync=False, sync_dir=False) as private:
            current = private
            sha, size = fmt.write_shard(private, tensors, {META_KEY: json.dumps(meta, allow_nan=False)})
            current = tmp / name
        entry = {"save_id": sid, "rank": rank, "file": name, "sha256": sha, "bytes": size}
        current = _marker(tmp, rank, "done")
        durable.write_json(current, entry)
        return entry
    except (OSError, CheckpointError) as exc:
        why = f"{exc.strerror or exc} [errno {exc.errno}]" if isinstance(exc, OSError) else str(exc)
        error = f"rank {rank} could not write its part of step {step}, {current}: {why}"
        try:
            durable.write_json(_marker(tmp, rank, "failed"), {"save_id": sid, "rank": rank, "error": error})
        except OSError as again:
            log.error("could not leave a failed marker in %s either (%s): the committer waits until its timeout",
                      tmp, again)
        raise CheckpointError(error) from exc


def _read_markers(tmp: Path, world_size: int, sid: str) -> tuple[dict[int, dict], list[str]]:
    done, failed = {}, []
    for rank in range(world_size):
        for kind in ("failed", "done"):
            try:
                obj = json.loads(read_untrusted(_marker(tmp, rank, kind), MAX_MARKER_BYTES))
            except (OSError, ValueError, RecursionError, CheckpointCorrupt):
                continue
            if not isinstance(obj, dict) or obj.get("save_id") != sid or obj.get("rank") != rank:
                continue
            if kind == "failed":
                failed.append(str(obj.get("error", f"rank {rank} failed")))
                break
            if obj.get("file") == rank_file(rank):
                done[rank] = obj
    return done, failed


def commit(folder: Path, step: int, sid: str, manifest: dict, *, timeout: float,
           give_up=lambda: False) -> Path:
    """Wait until every rank of `manifest["world_size"]` left its done marker in the save's temp
    folder, then write the manifest and rename the folder into place. `give_up()` true: stop
    waiting (the temp folder stays, so a re-save of this step can still finish it)."""
    tmp, world = temp_for(folder, step, sid), manifest["world_size"]
    start = time.monotonic()
    while True:
        done, failed = _read_markers(tmp, world, sid)
        if failed:
            durable.remove(tmp)
            raise CheckpointError(f"checkpoint {folder} of step {step} abandoned: " + "; ".join(failed))
        missing = [r for r in range(world) if r not in done]
        if not missing:
            break
        waited = time.monotonic() - start
        if waited >= timeout:
            raise CheckpointError(f"checkpoint {folder} of step {step} is not complete: waited {timeout:g} s for "
                                  f"rank(s) {missing} to write their part into {tmp}; is the directory shared by "
                                  "every rank?")
        if give_up():
            raise CheckpointError(f"checkpoint {folder} of step {step} is not complete: the job is recovering or "
                                  f"leaving, and rank(s) {missing} have not written their part into {tmp}")
        time.sleep(POLL_S)
    for rank in range(world):
        _marker(tmp, rank, "done").unlink(missing_ok=True)
    for leftover in tmp.glob(".rank_*"):  # a private file of a writer killed before its rename
        leftover.unlink(missing_ok=True)
    written = {e["file"]: {"sha256": e["sha256"], "bytes": e["bytes"]} for e in done.values()}
    return fmt.commit_checkpoint(folder, f"{step}-{sid}", manifest, written=written)


def ranks_entry(blobs: dict[int, bytes]) -> dict:
    """The manifest's "ranks": each rank's file, data position and own state (a pickle-free blob)."""
    return {str(r): {"file": rank_file(r), "progress": unpack(blob, f"rank {r}'s state")["progress"],
                     "state": base64.b64encode(blob).decode("ascii")} for r, blob in sorted(blobs.items())}


# --- reading ---------------------------------------------------------------------------------


def _read(manifest: Manifest, name: str) -> tuple[dict, dict]:
    path = manifest.folder / name
    tensors, metadata = fmt.read_shard_metadata(path, manifest.files[name])
    try:
        return tensors, json.loads(metadata[META_KEY])
    except (KeyError, ValueError, RecursionError) as exc:
        raise corrupt(path, f"has no readable {META_KEY} metadata ({exc!r})") from None


def read_rank_file(manifest: Manifest, name: str, *, repair: bool = True) -> tuple[dict, dict, str]:
    """(tensors, codec meta, the file they came from): `name`, else a bit-identical replica, which
    then also rewrites `name` when `repair`. CheckpointCorrupt names every file tried."""
    errors = []
    for source in [name, *manifest.stand_ins(name)]:
        try:
            tensors, meta = _read(manifest, source)
        except CorruptFile as exc:
            errors.append(exc.problem)
            continue
        if source != name:
            log.warning("%s; read its bit-identical replica %s instead", errors[0], source)
            if repair:
                copy_replica(manifest, name, source)
        return tensors, meta, source
    raise corrupt(manifest.folder / name, f"no intact copy is left ({' | '.join(errors)})")


def copy_replica(manifest: Manifest, name: str, source: str) -> bool:
    """Rewrite `name` with the bytes of `source`, kept only if its sha256 matches the manifest."""
    folder = manifest.folder
    try:
        entry = manifest.files[name]
        data = read_untrusted(folder / source, entry.bytes, expect=entry.bytes)
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise OSError(f"{source} changed while it was copied")
        durable.write_bytes(folder / name, data)
    except (OSError, CheckpointCorrupt) as exc:
        log.warning("could not rewrite %s from its replica %s: %s", folder / name, source, exc)
        return False
    log.warning("rewrote %s from its replica %s (sha256 matches the manifest)", folder / name, source)
    return True


def _own_state(manifest: Manifest, rank: int) -> dict:
    try:
        return unpack(base64.b64decode(manifest.ranks[rank].state, validate=True), f"rank {rank}'s state")
    except (ValueError, CheckpointCorrupt) as exc:
        raise corrupt(manifest.path, f"rank {rank}'s state is unreadable ({exc})") from None


def load_rank(folder: Path, rank: int, world_size: int) -> tuple[dict, str]:
    """({"shared", "own"} of `rank`, the file its shared state came from), verified."""
    manifest = read(folder)
    if manifest.kind is not Kind.JOB:
        raise CheckpointError(f"{folder}: is not a training job's checkpoint (format 3); load it with "
                              "trainguard.load_checkpoint")
    if manifest.world_size != world_size:
        raise CheckpointError(f"{folder}: was saved by {manifest.world_size} ranks, this job has {world_size}")
    tensors, meta, source = read_rank_file(manifest, manifest.ranks[rank].file)
    own = _own_state(manifest, rank)
    return {"shared": unflatten_state(tensors, meta, copy=False), "own": own}, source


class Waiter:
    """A background writer that a recovery can hurry: `settle(patience)` lets a commit still
    waiting for peers wait `patience` seconds more, then makes it give up."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self._give_up_at = float("inf")

    def start(self, target, **kwargs) -> None:
        self._give_up_at = float("inf")
        self.thread = threading.Thread(target=target, kwargs=kwargs, name="trainguard-ckpt", daemon=True)
        self.thread.start()

    def give_up(self) -> bool:
        return time.monotonic() >= self._give_up_at

    def settle(self, patience: float | None) -> None:
        if self.thread is None:
            return
        if patience is not None:
            self._give_up_at = time.monotonic() + patience
        self.thread.join()
        self.thread, self._give_up_at = None, float("inf")


# --- version 3's open, verify and recover (dispatched by replicas.py) -------------------------------


def open_job(manifest: Manifest, *, prefer: int = 0, avoid: frozenset[int] = frozenset()) -> PieceReader:
    """Rank 0's shared state (data parallel: every rank's), or a replica of it, as whole tensors."""
    name = manifest.ranks[0].file
    return single_reader(manifest, name, read_rank_file(manifest, name, repair=False)[0])


def verify_job(manifest: Manifest) -> Verified:
    """Hash every rank file of a job checkpoint and check every rank's state; say which damaged
    files still have an intact bit-identical replica."""
    problems, damaged, bad = {}, set(), set()
    for r, entry in enumerate(manifest.ranks):
        try:
            if entry.file not in bad and entry.file not in problems:
                _read(manifest, entry.file)
        except CorruptFile as exc:
            problems[entry.file] = exc.reason
            bad.add(entry.file)
            damaged.add(r)
        try:
            _own_state(manifest, r)
        except CorruptFile as exc:
            problems[f"{MANIFEST} (rank {r}'s state)"] = exc.reason
    lost = [name for name in sorted(bad) if bad.issuperset(manifest.stand_ins(name))]
    lost += [p for p in problems if p.startswith(MANIFEST)]
    return Verified(manifest.folder, problems, sorted(damaged), lost, manifest.world_size)


def recover_job(manifest: Manifest, rank: int) -> Recovered:
    """Rewrite rank `rank`'s file from an intact bit-identical replica; an intact file stays."""
    folder = manifest.folder
    if not 0 <= rank < manifest.world_size:
        raise CheckpointError(f"{folder}: has ranks 0..{manifest.world_size - 1}; there is no rank {rank}")
    name = manifest.ranks[rank].file
    _, _, source = read_rank_file(manifest, name, repair=False)
    if source == name:
        return Recovered(folder / name, (), True)
    if not copy_replica(manifest, name, source):
        raise CheckpointError(f"{folder / name}: could not be rewritten from its replica {source}; see the log")
    holder = next(r for r, e in enumerate(manifest.ranks) if e.file == source)
    return Recovered(folder / name, (holder,), False)
