"""The one manifest parser: every version parses into a typed Manifest, and any damage to the file,
whatever its shape, is a CheckpointCorrupt naming it (never a TypeError, KeyError or RecursionError)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.format import save_checkpoint
from trainguard.checkpoint.layout import CheckpointLayout, Piece, Slice, TensorLayout
from trainguard.checkpoint.replicas import verify_checkpoint
from trainguard.checkpoint.safeheader import CorruptFile
from trainguard.errors import CheckpointCorrupt

pytestmark = pytest.mark.timeout(120)

FOLDER = Path("/nonexistent/ck-1_4")
SHA = hashlib.sha256(b"x").hexdigest()
FILES = {"rank_0.safetensors": {"sha256": SHA, "bytes": 10}, "rank_1.safetensors": {"sha256": SHA, "bytes": 10}}
LAYOUT = CheckpointLayout("sliced", ("rank_0.safetensors", "rank_1.safetensors"),
                          {"w": TensorLayout("F32", (4,), (Piece(Slice((0,), (2,)), (0,)), Piece(Slice((2,), (2,)), (1,))),
                                             ("S(0)",))}, ((0,), (1,)))


def valid(version: int) -> dict:
    m = {"format_version": version, "step": 4, "epoch": 1, "world_size": 2, "meta": {"k": [1]}, "append_info": None,
         "files": copy.deepcopy(FILES), "created": 1.5}
    if version == 2:
        m["layout"] = LAYOUT.to_json()
    if version == 3:
        m["ranks"] = {str(r): {"file": f"rank_{r}.safetensors", "progress": {"step": 4, "epoch": 1, "in_epoch": 4},
                               "state": "AAAA"} for r in range(2)}
    return m


def parse(obj) -> mf.Manifest:
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return mf.parse(data, FOLDER)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_each_version_parses_into_one_typed_value(version):
    m = parse(valid(version))
    assert m.kind is mf.Kind(version) and m.version == version and (m.step, m.epoch, m.world_size) == (4, 1, 2)
    assert m.files["rank_0.safetensors"] == mf.FileEntry(SHA, 10) and m.path == FOLDER / "manifest.json"
    assert (m.layout == LAYOUT) == (version == 2) and len(m.ranks) == (2 if version == 3 else 0)
    assert m.label == {1: "per-rank", 2: "sliced", 3: "job"}[version]
    assert m.raw == valid(version)
    # only a job's files are bit-identical replicas of each other
    assert m.stand_ins("rank_0.safetensors") == (["rank_1.safetensors"] if version == 3 else [])


MALFORMED = {
    "nested too deep": b"[" * 200_000 + b"]" * 200_000,
    "not utf-8": b"\xff\xfe{}",
    "a list": b"[]",
    "huge int": b'{"format_version": 1' + b"0" * 5000 + b"}",
    "files is a list": {**valid(1), "files": []},
    "entry is a list": {**valid(1), "files": {"rank_0.safetensors": [SHA, 10]}},
    "sha not hex": {**valid(1), "files": {"rank_0.safetensors": {"sha256": "z" * 64, "bytes": 1}}},
    "bytes is a bool": {**valid(1), "files": {"rank_0.safetensors": {"sha256": SHA, "bytes": True}}},
    "file name is a path": {**valid(1), "files": {"../x.safetensors": {"sha256": SHA, "bytes": 1}}},
    "layout is a list": {**valid(2), "layout": []},
    "layout in version 1": {**valid(1), "layout": LAYOUT.to_json()},
    "ranks in version 2": {**valid(2), "ranks": {}},
    "ranks not every rank": {**valid(3), "ranks": {"0": valid(3)["ranks"]["0"]}},
    "rank entry is a string": {**valid(3), "ranks": {"0": "x", "1": "y"}},
    "piece ranks are strings": {**valid(2), "layout": {**LAYOUT.to_json(), "tensors": {
        "w": {"dtype": "F32", "shape": [4], "pieces": [{"offsets": [0], "lengths": [4], "ranks": ["0"]}]}}}},
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_is_corrupt_and_names_the_file(case):
    with pytest.raises(CheckpointCorrupt) as info:
        parse(MALFORMED[case])
    assert isinstance(info.value, CorruptFile) and info.value.path == FOLDER / "manifest.json"
    assert str(info.value).startswith(f"{FOLDER / 'manifest.json'}: ") and info.value.reason in str(info.value)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=10)


def _places(obj, at=()):
    yield at
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _places(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _places(v, (*at, i))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version=st.sampled_from([1, 2, 3]), pick=st.integers(min_value=0), value=JSON, drop=st.booleans())
def test_any_field_replaced_by_any_json_parses_or_is_corrupt(version, pick, value, drop):
    m = valid(version)
    places = list(_places(m))[1:]
    *parent_path, key = places[pick % len(places)]
    parent = m
    for k in parent_path:
        parent = parent[k]
    if drop and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = value
    try:
        parsed = parse(m)
    except CorruptFile as exc:
        assert exc.path == FOLDER / "manifest.json"
        return
    assert parsed.kind is mf.Kind(version)


def test_verify_reports_the_reason_from_the_error_fields(tmp_path):
    folder = save_checkpoint(tmp_path / "ck-0_1", {"rank_0.safetensors": {"a": torch.ones(3)}}, meta={}, step=1,
                             epoch=0, world_size=1)
    data = bytearray((folder / "rank_0.safetensors").read_bytes())
    data[-1] ^= 1
    (folder / "rank_0.safetensors").write_bytes(bytes(data))
    result = verify_checkpoint(folder)
    assert result.problems == {"rank_0.safetensors": "sha256 does not match the manifest (the file was altered or "
                                                      "bits flipped)"}
    assert result.unrecoverable == ["rank_0.safetensors"] and not result.ok


def test_a_corrupt_file_error_survives_pickling():
    import pickle

    exc = pickle.loads(pickle.dumps(CorruptFile(Path("/x/y"), "is odd")))
    assert (exc.path, exc.reason, str(exc)) == (Path("/x/y"), "is odd", "/x/y: is odd; fall back to an earlier checkpoint")
