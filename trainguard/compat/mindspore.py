"""MindSpore-style names, for scripts ported from MindSpore's disaster-recovery and sliced-checkpoint
features (../shared/reference): `Model(net, loss_fn, optimizer).train(...)` with callbacks,
`ModelCheckpoint` / `CheckpointConfig`, `load_checkpoint` / `load_param_into_net` (a flat dict of
whole tensors, from any checkpoint trainguard writes) and `restore_group_info_list`.

    from trainguard.compat import mindspore as ms
    model = ms.Model(net, loss_fn, optimizer)
    model.train(epochs, dataset, callbacks=[ms.LossMonitor(), ms.ModelCheckpoint("net", "ckpt", config)])

These names are also reachable as `trainguard.<name>` for scripts written before this module; the
core API (`init`, `DDP`, `Optimizer`, `DataLoader`, `Session`, ...) is trainguard's own. The
environment variables MindSpore's docs use (MS_ENABLE_RECOVERY, MS_RECOVERY_PATH, ...) are read by
`trainguard.init()` as aliases of the TG_* ones (config.py).
"""

from ..checkpoint.replicas import restore_group_info_list
from ..checkpoint.reshard import load_checkpoint, load_param_into_net
from ..train.engine.callbacks import Callback, LossMonitor
from ..train.engine.callbacks import StepTimeMonitor as TimeMonitor
from ..train.state.checkpointing import CheckpointConfig, ExceptionCheckpoint, ModelCheckpoint
from ..train.engine.model import Model

__all__ = ["Callback", "CheckpointConfig", "ExceptionCheckpoint", "LossMonitor", "Model", "ModelCheckpoint",
           "TimeMonitor", "load_checkpoint", "load_param_into_net", "restore_group_info_list"]
