"""Data-parallel training of a small CNN on scikit-learn's digits (shipped with sklearn, no download).

    trainguard run --workers 2 examples/digits.py
    TG_FAULT=1:60:kill trainguard run --workers 2 examples/digits.py     # kill -9 rank 1 after step 60

Every rank prints its test accuracy at the end. With --out, rank 0 saves the final weights and
optimizer state as safetensors, so a run with faults can be compared with one without.
"""

import argparse

import torch
from digits_data import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import trainguard
from trainguard import (
    CheckpointConfig,
    LossMonitor,
    Model,
    ModelCheckpoint,
    StepTimeMonitor,
)

# --- arguments -----------------------------------------------------------------
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--ckpt-dir", default="", help="save disk checkpoints here (per rank)")
parser.add_argument("--save-steps", type=int, default=50)
parser.add_argument("--out", default="", help="rank 0 writes final model+optimizer state here")
parser.add_argument("--check-replicas", action="store_true", help="verify after every step that all ranks "
                    "hold bit-identical weights")
args = parser.parse_args()

# --- cluster ---------------------------------------------------------------------
trainguard.init()
rank = trainguard.get_rank()
torch.manual_seed(0)

# --- data: 8x8 digits, a fixed 80/20 split -----------------------------------------
digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
labels = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(42))
n_train = int(0.8 * len(labels))
train_set = TensorDataset(images[order[:n_train]], labels[order[:n_train]])
test_set = TensorDataset(images[order[n_train:]], labels[order[n_train:]])

# --- model ---------------------------------------------------------------------------
net = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
)
optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
model = Model(net, nn.CrossEntropyLoss(), optimizer)

# --- train -----------------------------------------------------------------------------
callbacks = [LossMonitor(20), StepTimeMonitor(100)]
if args.check_replicas:
    from trainguard.testing import ReplicaCheck

    replica_check = ReplicaCheck(net)
    callbacks.append(replica_check)
if args.ckpt_dir:
    config = CheckpointConfig(save_checkpoint_steps=args.save_steps, keep_checkpoint_max=3)
    callbacks.append(ModelCheckpoint(prefix="digits", directory=args.ckpt_dir, config=config))
model.train(args.epochs, train_set, callbacks=callbacks, batch_size=args.batch_size)

# --- evaluate and save -------------------------------------------------------------------
accuracy = model.eval(test_set)["accuracy"]
print(f"rank {rank}: test accuracy {accuracy:.4f}", flush=True)
if args.check_replicas:
    print(f"rank {rank}: weights identical on every rank after each of {replica_check.checked} steps", flush=True)
if args.out and rank == 0:
    trainguard.save_state(args.out, {"model": net.state_dict(), "optimizer": optimizer.state_dict()})
