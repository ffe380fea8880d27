"""Loading a checkpoint into another parallel layout gives the same full tensors, bit for bit.

A group of 4 gloo processes saves (dp=2, tp=2), 4-rank DP and HSDP (2x2) states, integrated and
sliced, and loads (dp=2, tp=2) into (dp=4, tp=1). A group of 2 then loads (dp=2, tp=2) into
(dp=1, tp=2) and into FSDP2, the 4-rank DP state into 2 ranks, and HSDP into tensor parallel.
Every rank checks its loaded model and Adam state against the saving group's full state;
rank 0 writes what it loaded, gathered whole, which the tests here compare with each other.
"""

import pytest
import torch
from shard_group import run_group
from torch import nn

import trainguard as tg
from trainguard.checkpoint.codec import flatten_state
from trainguard.checkpoint.layout import (
    Piece,
    Slice,
    TensorLayout,
    check_cover,
    group_pieces,
)
from trainguard.errors import CheckpointError

pytestmark = pytest.mark.timeout(300)  # the module fixture (a 4-process job) counts in the first test


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    run_group("reshard_source", 4, out)
    run_group("reshard_target", 2, out)
    return out


def mlp(seed=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))


def flat(state):
    return flatten_state(state)


def assert_same(a, b, where):
    (ta, ma), (tb, mb) = flat(a), flat(b)
    assert ma == mb, where
    assert ta.keys() == tb.keys(), where
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), f"{where}: {k}"


def load_plain(folder):
    """(dp=2, tp=2) -> one process, plain nn.Module and Adam."""
    net = mlp()
    opt = torch.optim.Adam(net.parameters(), lr=1.0)
    tg.init_optimizer_state(opt)
    loaded = tg.load_sharded(folder, {"model": net.state_dict(), "optim": opt.state_dict()})
    net.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])
    return {"model": net.state_dict(), "optim": opt.state_dict()}


@pytest.mark.parametrize("kind", ["sliced", "full"])
def test_the_four_reshardings_give_identical_full_tensors(resharded, kind):
    ref = tg.load_state(resharded / "dptp-2x2" / "ref.safetensors")
    cases = {
        "(dp2,tp2)->(dp1,tp2)": tg.load_state(resharded / "loaded" / f"dptp-2x2_to_dptp-1x2_{kind}.safetensors"),
        "(dp2,tp2)->(dp4,tp1)": tg.load_state(resharded / "loaded" / f"dptp-2x2_to_dptp-4x1_{kind}.safetensors"),
        "(dp2,tp2)->one process": load_plain(resharded / "dptp-2x2" / kind),
        "(dp2,tp2)->fsdp x2": tg.load_state(resharded / "loaded" / f"dptp-2x2_to_fsdp_{kind}.safetensors"),
    }
    for where, got in cases.items():
        assert_same(got, ref, where)
    dp_ref = tg.load_state(resharded / "dp" / "ref.safetensors")
    assert_same(tg.load_state(resharded / "loaded" / f"dp_to_dp_{kind}.safetensors"), dp_ref, "4-rank DP -> 2")
    hsdp_ref = tg.load_state(resharded / "hsdp-2x2" / "ref.safetensors")
    assert_same(tg.load_state(resharded / "loaded" / f"hsdp-2x2_to_tp_{kind}.safetensors"), hsdp_ref, "HSDP -> TP")


def test_sliced_reading_opens_only_the_files_it_needs(resharded, monkeypatch):
    from trainguard.checkpoint import pieces

    opened = []
    real = pieces.read_shard
    monkeypatch.setattr(pieces, "read_shard", lambda path, entry, verify=True: opened.append(path.name) or
                        real(path, entry, verify))
    net = mlp()
    tg.load_sharded(resharded / "dptp-2x2" / "sliced", {"model": net.state_dict()}, strict=False)
    assert sorted(opened) == ["rank_0.safetensors", "rank_1.safetensors"]  # tp0 and tp1: one copy of each


def test_target_missing_optimizer_state_is_a_clear_error(resharded):
    net = mlp()
    opt = torch.optim.Adam(net.parameters())  # no state yet
    with pytest.raises(CheckpointError, match=r"not in the target: \[optim/state/0/exp_avg.*initialise the optimizer"):
        tg.load_sharded(resharded / "dptp-2x2" / "sliced", {"model": net.state_dict(), "optim": opt.state_dict()})
    loaded = tg.load_sharded(resharded / "dptp-2x2" / "sliced",
                             {"model": net.state_dict(), "optim": opt.state_dict()}, strict=False)
    ref = tg.load_state(resharded / "dptp-2x2" / "ref.safetensors")
    assert_same(net.state_dict(), ref["model"], "model loaded in place")
    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], ref["optim"]["state"][0]["exp_avg"])


def test_load_without_target_gives_the_whole_state(resharded):
    ref = tg.load_state(resharded / "hsdp-2x2" / "ref.safetensors")
    assert_same(tg.load_sharded(resharded / "hsdp-2x2" / "sliced"), ref, "no target")


def test_init_optimizer_state_leaves_parameters_alone():
    net = mlp()
    before = net.state_dict()
    before = type(before)((k, v.clone()) for k, v in before.items())
    before._metadata = net.state_dict()._metadata
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.5)
    tg.init_optimizer_state(opt)
    assert_same(net.state_dict(), before, "parameters")
    assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.param_groups[0]["lr"] == 0.1 and all(p.grad is None for p in net.parameters())


# --- slice arithmetic ---------------------------------------------------------------------------


def test_slice_intersection_and_index():
    a, b = Slice((0, 4), (8, 8)), Slice((6, 0), (4, 6))
    common = a.intersect(b)
    assert common == Slice((6, 4), (2, 2)) and common.within(a) == (slice(6, 8), slice(0, 2))
    assert common.within(b) == (slice(0, 2), slice(4, 6))
    assert a.intersect(Slice((8, 0), (2, 16))) is None  # touching is not overlapping
    assert str(a) == "[0:8, 4:12]" and Slice.full((3, 2)).numel == 6 and Slice((), ()).numel == 1


def test_pieces_group_equal_slices_and_check_cover():
    halves = [Slice((0,), (5,)), Slice((5,), (5,))]
    pieces = group_pieces([halves[0], halves[1], halves[0], None])
    assert pieces == (Piece(halves[0], (0, 2)), Piece(halves[1], (1,)))
    check_cover((10,), pieces)
    with pytest.raises(ValueError, match=r"cover \[0:5\] of \[0:10\]"):
        check_cover((10,), pieces[:1])
    with pytest.raises(ValueError, match="outside"):
        check_cover((8,), pieces)
    with pytest.raises(ValueError, match="overlap at 3"):
        check_cover((10,), [Piece(Slice((0,), (5,)), (0,)), Piece(Slice((3,), (7,)), (1,))])
    with pytest.raises(ValueError, match="distinct: 1"):
        check_cover((10,), [Piece(Slice((0,), (10,)), (0,)), Piece(Slice((0,), (10,)), (1,))])
    quarter = [Piece(Slice((r, c), (2, 2)), (i,)) for i, (r, c) in enumerate([(0, 0), (0, 2), (2, 0), (2, 2)])]
    check_cover((4, 4), quarter)
    check_cover((4, 4), quarter + [Piece(Slice((4, 0), (0, 4)), (9,))])  # an empty piece (uneven shard)
    with pytest.raises(ValueError, match="do not fill the 4 cells"):
        check_cover((4, 4), quarter[:3])
    check_cover((), [Piece(Slice((), ()), (0, 1))])  # a scalar
    spec = TensorLayout("F32", (10,), pieces)
    assert [c for _, c in spec.overlapping(Slice((3,), (4,)))] == [Slice((3,), (2,)), Slice((5,), (2,))]
