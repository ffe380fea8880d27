"""`rank_{r}.group_info.json`: the ranks whose slices are identical to rank r's, as MindSpore keeps them.

Each rank of a sliced save writes its own next to its file; with dp=2 x tp=4 on
``DeviceMesh(arange(8).view(2, 4))`` rank 0's says [0, 4]. The manifest's layout holds the same
lists for every rank and is the authority when the two differ (`replicas.restore_group_info_list`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import durable
from .safeheader import CorruptFile, read_untrusted

GROUP_INFO_KIND = "trainguard-group-info"
RECREATE = "recreate it with `trainguard ckpt recover`"
MAX_GROUP_INFO_BYTES = 64 << 20  # a list of ranks


def group_info_file(rank: int) -> str:
    return f"rank_{rank}.group_info.json"


def write_group_info(folder: Path, rank: int, ranks: list[int], world_size: int) -> Path:
    path = Path(folder) / group_info_file(rank)
    durable.write_json(path, {"kind": GROUP_INFO_KIND, "version": 1, "rank": rank, "world_size": world_size,
                         "group_info": sorted(ranks)})
    return path


def read_group_info(path: Path, rank: int | None) -> list[int]:
    """The ranks in the group info file at `path` (of `rank`, when given); CorruptFile otherwise."""
    try:
        obj = json.loads(read_untrusted(path, MAX_GROUP_INFO_BYTES))
    except FileNotFoundError:
        raise CorruptFile(path, "is missing", RECREATE) from None
    except CorruptFile as exc:
        raise CorruptFile(path, exc.reason, RECREATE) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CorruptFile(path, f"is not a readable JSON group info file ({exc})", RECREATE) from None
    ranks = obj.get("group_info") if isinstance(obj, dict) else None
    own = obj.get("rank") if isinstance(obj, dict) else None
    if (obj.get("kind") if isinstance(obj, dict) else None) != GROUP_INFO_KIND or type(own) is not int \
            or not isinstance(ranks, list) or not all(type(r) is int and r >= 0 for r in ranks) or own not in ranks:
        raise CorruptFile(path, "is not a trainguard group info file (needs 'kind', 'rank' and a 'group_info' list "
                          "of ranks that includes it)", RECREATE)
    if rank is not None and own != rank:
        raise CorruptFile(path, f"holds the group info of rank {own}, not rank {rank}", RECREATE)
    return sorted(ranks)
