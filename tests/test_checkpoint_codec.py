import json
import random
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trainguard.checkpoint.codec import flatten_state, state_nbytes, unflatten_state
from trainguard.errors import CheckpointCorrupt, CheckpointError

pytestmark = pytest.mark.timeout(60)


def assert_same(a, b, path="<root>"):
    """Exact equality: same Python types, dtypes, shapes, bytes and float bits."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.contiguous().reshape(-1).view(torch.uint8).tolist() == \
            b.contiguous().reshape(-1).view(torch.uint8).tolist(), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        assert [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k!r}")
        assert_same(getattr(a, "_metadata", None), getattr(b, "_metadata", None), f"{path}._metadata")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def roundtrip(obj, **kw):
    tensors, meta = flatten_state(obj, **kw)
    json.dumps(meta, allow_nan=False)
    return tensors, meta, unflatten_state(tensors, meta)


def training_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(6, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            "progress": {"step": 2, "epoch": 0, "loss": float("nan")}}


def test_realistic_training_state_round_trips_exactly():
    state = training_state()
    tensors, meta, back = roundtrip(state)
    assert_same(state, back)
    assert "optimizer/state/0/exp_avg" in tensors and "model/0.weight" in tensors and "rng/torch" in tensors
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    assert 0 in back["optimizer"]["state"] and "0" not in back["optimizer"]["state"]
    assert back["model"]._metadata == state["model"]._metadata
    assert state_nbytes(tensors) == sum(t.numel() * t.element_size() for t in tensors.values())

    # the restored state drives real objects
    random.setstate(back["rng"]["python"])
    np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model.load_state_dict(back["model"])
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(back["optimizer"])
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)


def test_special_scalars_and_keys():
    obj = {0: "int key", "0": "str key", -5: None, "f": [float("nan"), float("inf"), float("-inf"), -0.0, 0.1,
           1e308, 5e-324], "big": 2**100, "neg": -(2**70), "b": b"\x00\xff", "e": b"", "t": (), "l": [],
           "nested": ((1, [2, (3,)]), {}), "bool": [True, False], "np": [np.float32(1.5), np.int64(-3),
           np.bool_(True)], "od": OrderedDict(a=1)}
    _, meta, back = roundtrip(obj)
    assert_same(obj, back)
    neg_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000001))[0]
    assert struct.pack("<d", roundtrip([neg_nan])[2][0]) == struct.pack("<d", neg_nan)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
                                   torch.bfloat16, torch.float32, torch.float64])
def test_tensor_dtypes_shapes_and_copies(dtype):
    base = (torch.arange(24) % 3).to(dtype).reshape(2, 3, 4)
    obj = {"0d": base.reshape(-1)[5].clone(), "nc": base.transpose(0, 2), "slice": base[:, 1], "empty": base[:0]}
    assert not obj["nc"].is_contiguous()
    tensors, _, back = roundtrip(obj)
    assert_same(obj, back)
    for key, t in tensors.items():
        assert t.is_contiguous() and t.device.type == "cpu"
        assert t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr(), key


def test_snapshot_is_not_aliased():
    model = torch.nn.Linear(3, 3)
    tensors, meta = flatten_state({"w": model.weight, "sd": model.state_dict()})
    before = {k: v.clone() for k, v in tensors.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    assert all(torch.equal(before[k], tensors[k]) for k in tensors)
    assert not tensors["w"].requires_grad
    back = unflatten_state(tensors, meta)
    back["w"].add_(1.0)  # restoring twice from one snapshot must be possible
    assert torch.equal(tensors["w"], before["w"])


def test_copy_false_may_share_memory():
    t = torch.arange(4.0)
    tensors, meta = flatten_state({"t": t, "nc": torch.ones(2, 2).t()}, copy=False)
    assert tensors["t"].data_ptr() == t.data_ptr()
    assert tensors["nc"].is_contiguous()
    assert unflatten_state(tensors, meta, copy=False)["t"].data_ptr() == t.data_ptr()


def test_keys_are_unique_and_stable():
    obj = {0: torch.zeros(1), "0": torch.ones(1), "a/b": torch.zeros(2), "a": {"b": torch.ones(2)},
           "__metadata__": torch.zeros(3)}
    t1, m1, back = roundtrip(obj)
    t2, m2 = flatten_state(obj)
    assert list(t1) == list(t2) and m1 == m2 and len(t1) == 5 and "__metadata__" not in t1
    assert_same(obj, back)
    assert list(flatten_state(torch.ones(2))[0]) == ["tensor"]


@pytest.mark.parametrize("bad", [{"s": {1, 2}}, {(1, 2): 3}, {1.5: 0}, [object()], np.array([None]),
                                 [torch.ones(2).to_sparse()]])
def test_unsupported_values_are_refused(bad):
    with pytest.raises(CheckpointError, match="cannot store|not a str or int"):
        flatten_state(bad)


def test_cycle_is_refused():
    a: list = []
    a.append(a)
    with pytest.raises(CheckpointError, match="cycle"):
        flatten_state({"a": a})
    shared = [1]
    assert_same(roundtrip([shared, shared])[2], [[1], [1]])  # shared, not cyclic: fine


def test_meta_and_tensors_must_match():
    tensors, meta = flatten_state({"a": torch.ones(1), "b": 1})
    with pytest.raises(CheckpointCorrupt, match="not stored"):
        unflatten_state({}, meta)
    with pytest.raises(CheckpointCorrupt, match="does not use"):
        unflatten_state({**tensors, "x": torch.ones(1)}, meta)
    with pytest.raises(CheckpointCorrupt, match="codec version"):
        unflatten_state(tensors, {"root": meta["root"]})
    with pytest.raises(CheckpointCorrupt, match="malformed|unknown"):
        unflatten_state({}, {"codec": 1, "root": {"t": "dict", "k": [1, 2], "v": [3]}})
    with pytest.raises(CheckpointCorrupt, match="unknown"):
        unflatten_state({}, {"codec": 1, "root": [1]})


# --- property test ----------------------------------------------------------------------------

_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    t = (torch.randn(shape, generator=gen) * 100).to(dtype)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


arrays = hnp.arrays(dtype=st.sampled_from([np.float32, np.float64, np.int64, np.uint32, np.bool_, np.uint8]),
                    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
leaves = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
          | st.text(max_size=8) | st.binary(max_size=8) | tensors() | arrays)
states = st.recursive(
    leaves,
    lambda kids: (st.lists(kids, max_size=4) | st.tuples(kids, kids) | st.tuples()
                  | st.dictionaries(st.text(max_size=6) | st.integers(-3, 3), kids, max_size=4)),
    max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states)
def test_property_round_trip(obj):
    _, _, back = roundtrip(obj)
    assert_same(obj, back)


def test_a_multistep_schedulers_counter_of_milestones_round_trips():
    """torch's MultiStepLR keeps its milestones in a collections.Counter: refused before ("cannot store a
    collections.Counter"), so a job with one failed at its first fault or SIGTERM (a blind port's finding)."""
    from collections import Counter

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    state = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 5, 5], gamma=0.1).state_dict()
    back = unflatten_state(*flatten_state(state))
    assert type(back["milestones"]) is Counter and back == state
