"""A plain Hugging Face Accelerate script, in the shape of accelerate's complete_cv_example and
by_feature/checkpointing.py: scikit-learn's digits, random shifts and noise drawn in the dataset's `__getitem__`
(as torchvision's random transforms draw), a small CNN with BatchNorm and dropout, AdamW with a OneCycleLR stepped
every optimizer step, gradient accumulation, gradient clipping, accuracy gathered with `gather_for_metrics`,
`save_state` every epoch and `--resume_from_checkpoint`.

    accelerate launch --cpu --num_processes 3 examples/accelerate/train_plain.py
    torchrun --nproc-per-node 3 examples/accelerate/train_plain.py --cpu

examples/accelerate/train.py is this script under trainguard (2 lines changed).
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset, TensorDataset


class Net(nn.Module):
    def __init__(self, channels=16, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.dropout = nn.Dropout(0.25)
        self.fc = nn.Linear(2 * channels * 2 * 2, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.dropout(torch.flatten(x, 1)))


class Augmented(Dataset):
    """Training images shifted by up to a pixel and lightly noised, drawn from torch's global generator in
    `__getitem__`, as torchvision's random transforms draw."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        dy, dx = torch.randint(-1, 2, (2,)).tolist()
        image = torch.roll(self.images[i], shifts=(dy, dx), dims=(1, 2))
        return image + 0.05 * torch.randn_like(image), self.labels[i]


def get_dataloaders(batch_size, num_workers=0):
    images, labels = load_digits(return_X_y=True)
    images = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(labels)
    split = int(0.8 * len(images))
    train = Augmented(images[:split], labels[:split])
    evaluation = TensorDataset(images[split:], labels[split:])
    return (DataLoader(train, batch_size=batch_size, shuffle=True, num_workers=num_workers),
            DataLoader(evaluation, batch_size=2 * batch_size, shuffle=False))


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)
    train_dataloader, eval_dataloader = get_dataloaders(args.batch_size, args.num_workers)
    model = Net(args.channels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_dataloader))
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    starting_epoch, resume_step = 0, None
    if args.resume_from_checkpoint:
        path = args.resume_from_checkpoint
        if path == "latest":
            dirs = sorted((d for d in os.listdir(args.output_dir) if d.startswith("epoch_")),
                          key=lambda d: int(d.split("_")[1]))
            path = os.path.join(args.output_dir, dirs[-1])
        accelerator.print(f"Resumed from checkpoint: {path}")
        accelerator.load_state(path)
        name = os.path.basename(path.rstrip("/"))
        if name.startswith("epoch_"):
            starting_epoch = int(name.split("_")[1]) + 1
        else:
            resume_step = int(name.split("_")[1])
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)

    overall_step = starting_epoch * len(train_dataloader) + (resume_step or 0)  # batches: names the step saves
    for epoch in range(starting_epoch, args.epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for inputs, targets in active_dataloader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            overall_step += 1
            if args.checkpointing_steps.isdigit() and overall_step % int(args.checkpointing_steps) == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))

        model.eval()
        correct, seen, eval_loss = 0, 0, 0.0
        for inputs, targets in eval_dataloader:
            with torch.no_grad():
                logits = model(inputs)
            predictions, references = accelerator.gather_for_metrics((logits.argmax(dim=-1), targets))
            eval_loss += F.cross_entropy(logits, targets, reduction="sum").item()
            correct += (predictions == references).sum().item()
            seen += references.numel()
        accelerator.print(f"epoch {epoch}: accuracy {100 * correct / seen:.2f} ({correct}/{seen}), "
                          f"eval loss {eval_loss / seen:.4f}, lr {lr_scheduler.get_last_lr()[0]:.6f}")
        if args.checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    accelerator.wait_for_everyone()
    if args.save_final and accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), args.save_final)
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Digits with Accelerate")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is present")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--channels", type=int, default=16, help="the first convolution's channels")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--num_workers", type=int, default=0, help="the training loader's worker processes")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--checkpointing_steps", default="epoch")
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--save_final", default=None)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
