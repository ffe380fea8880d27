"""The values `self.log` has accumulated in Lightning's epoch (its `_ResultCollection`), as plain data and back.

Each logged key is a `_ResultMetric`: its metadata (how it reduces, whether it syncs, on step or epoch) and either
tensors (the running value, the batch sizes summed for a mean, the last step's value) or, for a `torchmetrics.Metric`
logged as an object, that metric (an attribute of the LightningModule, named by `metric_attribute`), whose own state
tensors (`metric_state`), update count and last step's value are what the epoch has accumulated. A restore builds the
collection again from this, and puts the metric states back into the module's metrics. These are a rank's own values
(each rank accumulates its batches; they are synced when computed), so every rank's are kept (lightning_ranks.py).
"""

from __future__ import annotations

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

from ..errors import ConfigError

_REDUCE = {"mean": torch.mean, "max": torch.max, "min": torch.min, "sum": torch.sum}


def _reduce_name(meta) -> str:
    for name in ("mean", "max", "min", "sum"):
        if getattr(meta, f"is_{name}_reduction"):
            return name
    raise ConfigError(f"self.log({meta.name!r}, reduce_fx=...) with a custom reduction: trainguard keeps mean, max, "
                      "min and sum")


def _walk(value, take):
    if isinstance(value, torch.Tensor):
        return take(value)
    if isinstance(value, dict):
        return {str(k): _walk(v, take) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_walk(v, take) for v in value]
    return value


def on_cpu(value):
    """Tensors (in dicts, lists, tuples) detached and copied to the CPU: plain data to keep."""
    return _walk(value, lambda t: t.detach().cpu().clone())


def detached(value):
    """The same, the tensors detached but neither copied nor moved: data read at once (lightning_ranks.py copies the
    numbers into one vector), without `on_cpu`'s two copies of each tensor every step."""
    return _walk(value, torch.Tensor.detach)


def on_device(value, device):
    """`on_cpu`'s data with its tensors moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [on_device(v, device) for v in value]
    return value


def _metric_state(metric, take) -> dict:
    """A torchmetrics Metric's accumulated state (its `add_state` tensors), update count and last step's value."""
    out = {"states": {name: take(value) for name, value in metric.metric_state.items()},
           "updates": int(metric._update_count)}
    if isinstance(metric._forward_cache, torch.Tensor):
        out["forward_cache"] = take(metric._forward_cache)
    return out


def _put_metric_state(metric, saved: dict, device) -> None:
    for name, value in saved["states"].items():
        setattr(metric, name, on_device(value, device))
    metric._update_count = saved["updates"]
    metric._computed = None
    metric._forward_cache = on_device(saved["forward_cache"], device) if "forward_cache" in saved else None


def results_state(results, take=on_cpu) -> list:
    """The epoch's logged values of a `_ResultCollection` as plain data (pure but for the copies); `take`: how each
    tensor is taken (`on_cpu`, or `detached`)."""
    out = []
    for key, metric in results.items():
        meta, sync = metric.meta, metric.meta.sync
        entry = {"key": key, "fx": meta.fx, "name": meta.name, "prog_bar": meta.prog_bar, "logger": meta.logger,
                 "on_step": meta.on_step, "on_epoch": meta.on_epoch, "reduce": _reduce_name(meta),
                 "enable_graph": meta.enable_graph, "add_dataloader_idx": meta.add_dataloader_idx,
                 "dataloader_idx": meta.dataloader_idx, "metric_attribute": meta.metric_attribute,
                 "sync": bool(sync.should), "rank_zero_only": bool(sync.rank_zero_only),
                 "has_reset": bool(metric.has_reset), "updates": int(getattr(metric, "_update_count", 0))}
        if metric.is_tensor:
            tensors = {"value": take(metric.value)}
            if meta.is_mean_reduction:
                tensors["cumulated_batch_size"] = take(metric.cumulated_batch_size)
            if isinstance(metric._forward_cache, torch.Tensor):
                tensors["forward_cache"] = take(metric._forward_cache)
            entry["tensors"] = tensors
        else:  # a torchmetrics Metric, logged as an object
            if meta.metric_attribute is None:
                raise ConfigError(f"self.log({meta.name!r}, <a torchmetrics Metric>) that is not an attribute of the "
                                  "LightningModule: make it one (self.accuracy = Accuracy(...)), so that its state is "
                                  "found")
            entry["metric"] = _metric_state(metric.value, take)
        out.append(entry)
    return out


def load_results(results, saved: list, module, reduce_fn, device) -> None:
    """`saved` (results_state's) into `results`, and the logged Metrics' states into `module`'s metrics."""
    results.clear()
    for entry in saved:
        meta = _Metadata(fx=entry["fx"], name=entry["name"], prog_bar=entry["prog_bar"], logger=entry["logger"],
                         on_step=entry["on_step"], on_epoch=entry["on_epoch"], reduce_fx=_REDUCE[entry["reduce"]],
                         enable_graph=entry["enable_graph"], add_dataloader_idx=entry["add_dataloader_idx"],
                         dataloader_idx=entry["dataloader_idx"], metric_attribute=entry["metric_attribute"])
        meta.sync = _Sync(_should=entry["sync"], fn=reduce_fn, rank_zero_only=entry["rank_zero_only"])  # as self.log
        if "metric" in entry:
            value = module.get_submodule(entry["metric_attribute"])
            _put_metric_state(value, entry["metric"], device)
            metric = _ResultMetric(meta, False)
            metric.value, metric._forward_cache = value, value._forward_cache
        else:
            metric = _ResultMetric(meta, True)
            tensors = entry["tensors"]
            metric.value = tensors["value"].to(device)
            if "cumulated_batch_size" in tensors:
                metric.cumulated_batch_size = tensors["cumulated_batch_size"].to(device)
            if "forward_cache" in tensors:
                metric._forward_cache = tensors["forward_cache"].to(device)
        metric.has_reset = entry["has_reset"]
        if hasattr(metric, "_update_count"):
            metric._update_count = entry["updates"]
        results[entry["key"]] = metric
