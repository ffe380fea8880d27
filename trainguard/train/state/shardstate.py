"""A rank's part of a sharded training state, as plain local tensors, and loading it into rebuilt modules.

A DTensor (FSDP2's sharded parameters, tensor-parallel weights) is taken as its local tensor, so the
part is what this rank holds and nothing is gathered. The optimizer's per-parameter state is taken
the same way, with its hyperparameters (a changed learning rate comes back too).

Loading copies into the tensors of modules and an optimizer built afresh for the new group, in
place (the optimizer's state is created first): their DTensors keep the new mesh and their
placements, and only the local values change. The layout must be the one the part was taken on,
which holds within a job (fixed mesh, fixed rank); a checkpoint on disk is the way to another layout.
"""

from __future__ import annotations

import torch
from torch import nn

from ...checkpoint.reshard import init_optimizer_state
from ...errors import ConfigError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without DTensor: nothing is sharded
    DTensor = ()  # type: ignore[assignment,misc]


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def capture(model: nn.Module, optimizer: torch.optim.Optimizer, *, copy: bool) -> dict:
    """{"model": {name: tensor}, "optim": {"state": {index: {key: value}}, "groups": [hyperparameters]}}
    with local tensors: private CPU copies with `copy`, else the live tensors themselves."""
    take = (lambda t: local(t).detach().to("cpu", copy=True)) if copy else (lambda t: local(t).detach())
    model_part = {k: take(v) for k, v in model.state_dict().items()}
    osd = optimizer.state_dict()
    state = {str(i): {k: take(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in osd["state"].items()}
    return {"model": model_part, "optim": {"state": state, "groups": groups(optimizer)}}


def groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's hyperparameters, group by group (a copy)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def load(model: nn.Module, optimizer: torch.optim.Optimizer, part: dict) -> None:
    """Copy `part` (from `capture` on the same layout) into `model` and `optimizer`, in place."""
    if part["optim"]["state"]:
        init_optimizer_state(optimizer)
    else:  # a part taken before the first step has none: the optimizer as fresh (a rank going back to it from a
        optimizer.state.clear()  # later step adopted its own live state first)
    own = model.state_dict()
    osd = optimizer.state_dict()
    _same_keys("model", own, part["model"])
    _same_keys("optimizer state", {str(i) for i in osd["state"]}, part["optim"]["state"])
    with torch.no_grad():
        for name, t in own.items():
            _copy(local(t), part["model"][name], f"model/{name}")
        for i, s in osd["state"].items():
            saved = part["optim"]["state"][str(i)]
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    _copy(local(v), saved[k], f"optim/{i}/{k}")
    for group, saved in zip(optimizer.param_groups, part["optim"]["groups"]):
        group.update(saved)


def _same_keys(what: str, have, got) -> None:
    if set(have) != set(got):
        missing, extra = sorted(set(have) - set(got))[:5], sorted(set(got) - set(have))[:5]
        raise ConfigError(f"the {what} does not match the rebuilt modules (missing {missing}, unexpected {extra}): "
                            "the script must build the same modules every time it runs")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ConfigError(f"{name}: the rebuilt tensor is {tuple(dst.shape)} {dst.dtype}, the saved part "
                            f"{tuple(src.shape)} {src.dtype}: the script must build the same layout every time it runs")
    dst.copy_(src)


# --- a pipeline stage's state by name (checkpoint/union.py) --------------------------------------------------


def by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by its parameters' names in `model` (a pipeline stage's: the whole model's names,
    so the stages' states add up to the whole model's): {"state": {name: {key: value}}, "groups": [hyperparameters],
    "group_of": {name: group index}}. The live tensors, not copies."""
    osd, index = optimizer.state_dict(), _names_in_order(model, optimizer)
    return {"state": {index[i]: dict(s) for i, s in osd["state"].items()}, "groups": groups(optimizer),
            "group_of": {index[i]: g for g, group in enumerate(osd["param_groups"]) for i in group["params"]}}


def from_names(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """`optimizer.state_dict()`'s form of `saved` (from `by_name`, of any stage layout: a stage of another pipeline,
    or the whole model), for this `model`'s parameters."""
    osd, index = optimizer.state_dict(), _names_in_order(model, optimizer)
    missing = [n for n in index if n not in saved["group_of"]]
    if missing:
        raise ConfigError(f"the checkpoint holds no optimizer state for {missing[:5]}: the model's parameters must "
                          "keep the names they were saved with")
    param_groups = []
    for group in osd["param_groups"]:
        ids = group["params"]
        hyper = saved["groups"][saved["group_of"][index[ids[0]]]] if ids else {}
        param_groups.append({**group, **hyper, "params": ids})
    state = {i: saved["state"][index[i]] for g in osd["param_groups"] for i in g["params"] if index[i] in saved["state"]}
    return {"state": state, "param_groups": param_groups}


def _names_in_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names in `model` of the optimizer's parameters, in its state_dict's index order."""
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
