"""The framework scripts the framework benchmarks compare (Accelerate, the transformers Trainer, Lightning): each
plain script (run under torchrun) and its port (run under `trainguard run`), with the arguments both take.
`out` is a folder of the run's own."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
NAMES = ("accelerate", "transformers", "lightning")
LABELS = {"accelerate": "Accelerate", "transformers": "Trainer", "lightning": "Lightning"}
WORKERS = 3  # the benches' workers; a Lightning script is told its devices


def scripts(name: str, epochs: int, channels: int, out: str, workers: int = WORKERS) -> tuple[list[str], list[str]]:
    """(the plain script and its arguments, the port and its arguments); the scripts' own checkpoints off."""
    if name == "accelerate":
        common = ["--epochs", str(epochs), "--channels", str(channels), "--checkpointing_steps", "none"]
        return ([str(EXAMPLES / "accelerate" / "train_plain.py"), "--cpu", *common],
                [str(EXAMPLES / "accelerate" / "train.py"), *common])
    if name == "lightning":  # ModelCheckpoint stays on: the plain script has no switch for it
        common = ["--devices", str(workers), "--epochs", str(epochs), "--channels", str(channels), "--out", out]
        return ([str(EXAMPLES / "lightning" / "train_plain.py"), *common],
                [str(EXAMPLES / "lightning" / "train.py"), *common])
    common = ["--epochs", str(epochs), "--channels", str(channels), "--save_strategy", "no", "--output_dir", out]
    return ([str(EXAMPLES / "transformers" / "train_plain.py"), *common],
            [str(EXAMPLES / "transformers" / "train.py"), *common])
