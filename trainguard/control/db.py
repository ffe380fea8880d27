"""The scheduler's durable state: cluster.db under the recovery path (sqlite, WAL, synchronous=FULL).

Only membership changes are written (registration, death, generation change, job end), never
heartbeats, and of those only the rows that changed since the last save: a registration storm of
10,000 workers writes each node once, not the whole table once per registration. The scheduler
saves once per pass of its event loop (commit.py), so one fsync covers every change of that pass.
A corrupt or foreign file is an error, never a silent reset.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from ..errors import ClusterStateError
from .membership import Cluster, JobState, Node, NodeState

SCHEMA_VERSION = 1
DB_NAME = "cluster.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, rank INTEGER NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL,
    incarnation INTEGER NOT NULL, state TEXT NOT NULL, failures INTEGER NOT NULL
);
"""


def _row(n: Node) -> tuple:
    return (n.node_id, n.rank, n.host, n.pid, n.incarnation,
            (NodeState.ALIVE if n.state is NodeState.UNKNOWN else n.state).value, n.failures)


class ClusterDB:
    def __init__(self, directory: Path):
        self.path = Path(directory) / DB_NAME
        if self.path.is_file() and self.path.stat().st_size == 0:
            # sqlite would take an empty file for a new database and silently start over; ours always
            # holds at least its header page once created, so an empty one was truncated
            raise self._corrupt("the file is empty")
        self._conn = None
        self._written: dict[str, tuple] = {}  # node id -> its row as last committed
        self._meta: dict[str, str] = {}
        try:
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            ok = self._conn.execute("PRAGMA integrity_check").fetchone()[0]
            if ok != "ok":
                raise sqlite3.DatabaseError(ok)
            self._conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            if self._conn is not None:
                self._conn.close()
            raise self._corrupt(exc) from None

    def _corrupt(self, exc: Exception | str) -> ClusterStateError:
        return ClusterStateError(
            f"{self.path} is corrupt or not a trainguard state file ({exc}); nothing was changed. "
            f"Restore it from a backup, or move it aside to start a new job (checkpoints are kept)"
        )

    def load(self) -> Cluster | None:
        """The persisted cluster, or None for a new job. Alive nodes come back as UNKNOWN."""
        try:
            meta = dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
            rows = self._conn.execute(
                "SELECT node_id, rank, host, pid, incarnation, state, failures FROM nodes").fetchall()
        except sqlite3.DatabaseError as exc:
            raise self._corrupt(exc) from None
        self._meta = dict(meta)
        self._written = {row[0]: tuple(row) for row in rows}
        if not meta:
            return None
        try:
            if int(meta["schema"]) != SCHEMA_VERSION:
                raise ClusterStateError(
                    f"{self.path} has schema {meta['schema']}, this trainguard reads {SCHEMA_VERSION}; "
                    "finish the job with the version that started it, or move the file aside")
            cluster = Cluster(
                worker_num=int(meta["worker_num"]), generation=int(meta["generation"]),
                formed=meta["formed"] == "1", job=JobState(meta["job"]), root_cause=meta.get("root_cause", ""),
                next_generated_id=int(meta.get("next_generated_id", "0")), committed=int(meta.get("committed", "0")),
            )
            now = time.monotonic()
            for node_id, rank, host, pid, inc, state, failures in rows:
                st = NodeState(state)
                if st is NodeState.ALIVE:
                    st = NodeState.UNKNOWN
                cluster.nodes[node_id] = Node(node_id, int(rank), host, int(pid), int(inc), st, now,
                                              failures=int(failures))
        except (KeyError, ValueError) as exc:
            raise self._corrupt(exc) from None
        return cluster

    def save(self, cluster: Cluster, touched: set[str] | None = None) -> int:
        """Commit what changed since the last save (one transaction, one fsync); returns the rows written.
        `touched`: the only node ids whose rows may have changed (None: compare them all)."""
        meta = {
            "schema": str(SCHEMA_VERSION), "worker_num": str(cluster.worker_num),
            "generation": str(cluster.generation), "formed": "1" if cluster.formed else "0",
            "job": cluster.job.value, "root_cause": cluster.root_cause,
            "next_generated_id": str(cluster.next_generated_id), "committed": str(cluster.committed),
        }
        ids = cluster.nodes.keys() | self._written.keys() if touched is None else touched
        rows = {node_id: _row(cluster.nodes[node_id]) for node_id in ids if node_id in cluster.nodes}
        written = self._written
        changed = [row for node_id, row in rows.items() if written.get(node_id) != row]
        gone = [(node_id,) for node_id in ids if node_id not in cluster.nodes and node_id in written]
        new_meta = [(k, v) for k, v in meta.items() if self._meta.get(k) != v]
        if not (changed or gone or new_meta):
            return 0
        c = self._conn
        c.execute("BEGIN IMMEDIATE")
        try:
            c.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", new_meta)
            c.executemany("DELETE FROM nodes WHERE node_id = ?", gone)
            c.executemany("INSERT OR REPLACE INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?)", changed)
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        for (node_id,) in gone:
            del written[node_id]
        written.update((row[0], row) for row in changed)
        self._meta = meta
        return len(changed) + len(gone) + len(new_meta)

    def archive(self) -> Path:
        """Move a finished job's file aside so a new job can start here."""
        self._conn.close()
        dest = self.path.with_name(f"{DB_NAME}.{int(time.time())}.ended")
        self.path.rename(dest)
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(DB_NAME + suffix)
            if side.exists():
                side.unlink()
        self.__init__(self.path.parent)
        return dest

    def close(self) -> None:
        self._conn.close()
