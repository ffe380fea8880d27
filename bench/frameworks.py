"""The framework scripts the framework benchmarks compare: each plain script (run under torchrun) and its port (run
under `trainguard run`), with the arguments both take. `out` is a folder of the run's own."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
NAMES = ("accelerate", "transformers")


def scripts(name: str, epochs: int, channels: int, out: str) -> tuple[list[str], list[str]]:
    """(the plain script and its arguments, the port and its arguments); the scripts' own checkpoints off."""
    if name == "accelerate":
        common = ["--epochs", str(epochs), "--channels", str(channels), "--checkpointing_steps", "none"]
        return ([str(EXAMPLES / "accelerate" / "train_plain.py"), "--cpu", *common],
                [str(EXAMPLES / "accelerate" / "train.py"), *common])
    common = ["--epochs", str(epochs), "--channels", str(channels), "--save_strategy", "no", "--output_dir", out]
    return ([str(EXAMPLES / "transformers" / "train_plain.py"), *common],
            [str(EXAMPLES / "transformers" / "train.py"), *common])
