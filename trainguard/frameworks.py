"""Training frameworks whose own loop trainguard does not run live as the script wrote it, told apart by the modules a
script loaded.

PyTorch Lightning's Trainer (without trainguard's strategy, compat/lightning.py) and Fabric set up their own
processes, devices and process group from what they see: under `trainguard run` a plain Lightning script fails
inside Lightning (`IndexError` in `DDPStrategy.root_device`, since it sees LOCAL_RANK=1 and one CPU device), the
same way on every restart. A worker whose script fails with
such a framework loaded ends the job at once with a message that names it and what to do instead
(launch/worker_main.py), rather than restarting it into a crash loop. Decided by the modules loaded, never by
the error's text.

A script whose optimizer steps with no trainguard state in the process (torch's own DDP and optimizer under `trainguard
run`, or a Lightning Trainer that does not crash because its `devices` match the job) trains unprotected: nothing of
its progress is kept, and a fault runs it again from its top. Its rank 0 says so at the first step (`unguarded`,
worker/pginit.py), naming the port.
"""

from __future__ import annotations

from collections.abc import Container

UNSUPPORTED = (  # (a module the framework loads when it is used, its name)
    ("lightning.pytorch.trainer.trainer", "PyTorch Lightning's Trainer"),
    ("pytorch_lightning.trainer.trainer", "PyTorch Lightning's Trainer"),
    ("lightning.fabric.fabric", "Lightning Fabric"),
    ("lightning_fabric.fabric", "Lightning Fabric"),
)


# the module that runs it live (Lightning's Trainer loads Fabric too)
SUPPORTED_BY = {"PyTorch Lightning's Trainer": "trainguard.compat.lightning",
                "Lightning Fabric": "trainguard.compat.lightning"}


def unsupported_framework(modules: Container[str]) -> str | None:
    """The framework in `modules` (sys.modules) that trainguard cannot run live, or None (pure)."""
    return next((name for module, name in UNSUPPORTED
                 if module in modules and SUPPORTED_BY.get(name) not in modules), None)


def explain(framework: str) -> str:
    if framework == "PyTorch Lightning's Trainer":
        return ("this script trains with PyTorch Lightning's Trainer, which sets up its own processes, devices and "
                "process group from what it sees, and a restart would fail the same way: give it trainguard's "
                "strategy, `Trainer(strategy=trainguard.compat.lightning.Strategy(), ...)` (docs/porting.md)")
    return (f"this script trains with {framework}, which sets up its own processes, devices and process group: "
            "trainguard does not run it live yet, and a restart would fail the same way. Run it with torchrun, or "
            "train with trainguard's wrappers (docs/porting.md) or with Hugging Face Accelerate "
            "(trainguard.compat.accelerate)")


def unguarded(modules: Container[str]) -> str:
    """What rank 0 says when the script's optimizer first steps with no trainguard state in the process (pure)."""
    framework = unsupported_framework(modules)
    if framework == "PyTorch Lightning's Trainer":
        port = "give the Trainer trainguard's strategy, `Trainer(strategy=trainguard.compat.lightning.Strategy(), ...)`"
    elif framework is not None:
        port = (f"train with trainguard's wrappers (`trainguard.DDP`, `trainguard.Optimizer`) or Hugging Face "
                f"Accelerate (`trainguard.compat.accelerate`): trainguard does not run {framework} live")
    else:
        port = ("wrap the model and the optimizer in trainguard's (`trainguard.DDP`, `trainguard.Optimizer`; "
                "Accelerate: `import trainguard.compat.accelerate`)")
    return ("trainguard: WARNING: the script's optimizer stepped, but trainguard holds none of its state: this "
            "training is not protected. A fault runs the script again from its top (from its own checkpoint, if it "
            f"loads one) and the steps since are lost. To protect it, {port} (docs/porting.md)")
