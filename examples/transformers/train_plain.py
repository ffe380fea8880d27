"""A plain Hugging Face `transformers` Trainer script, in the shape of the library's image-classification examples:
scikit-learn's digits as a dataset of dicts, a small CNN with BatchNorm and dropout that returns its loss, AdamW
with a linear warmup and decay stepped every optimizer step, gradient accumulation, gradient clipping, an
evaluation with an accuracy metric every epoch, the Trainer's own checkpoints and `--resume_from_checkpoint`.

    torchrun --nproc-per-node 3 examples/transformers/train_plain.py --output_dir /tmp/digits-trainer

examples/transformers/train.py is this script under trainguard (the import of Trainer).
"""

import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed


class DigitsNet(nn.Module):
    def __init__(self, channels=16, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.dropout = nn.Dropout(0.25)
        self.classifier = nn.Linear(2 * channels * 2 * 2, num_classes)

    def forward(self, pixel_values, labels=None):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(pixel_values))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        logits = self.classifier(self.dropout(torch.flatten(x, 1)))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class DigitsDataset(torch.utils.data.Dataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"pixel_values": self.images[i], "labels": self.labels[i]}


def load_datasets():
    images, labels = load_digits(return_X_y=True)
    images = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(labels)
    split = int(0.8 * len(labels))
    return DigitsDataset(images[:split], labels[:split]), DigitsDataset(images[split:], labels[split:])


class PrintValidation(TrainerCallback):
    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero:
            print(f"validation epoch {state.epoch:.2f} step {state.global_step}: accuracy "
                  f"{metrics['eval_accuracy']:.6f} loss {metrics['eval_loss']:.8f}", flush=True)


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="digits-trainer")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--save_strategy", default="epoch", choices=["epoch", "steps", "no"])
    parser.add_argument("--save_steps", type=int, default=500)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--save_final", default=None, help="save the final state of every rank here (for comparisons)")
    args = parser.parse_args()

    set_seed(args.seed)
    train_dataset, eval_dataset = load_datasets()
    model = DigitsNet(args.channels)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=2 * args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=1e-4,
        warmup_steps=5,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        eval_strategy="epoch",
        save_strategy=args.save_strategy,
        save_steps=args.save_steps,
        save_total_limit=2,
        logging_steps=5,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      compute_metrics=compute_metrics, callbacks=[PrintValidation()])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()

    if args.save_final:
        os.makedirs(args.save_final, exist_ok=True)
        rank = int(os.environ.get("RANK", "0"))
        torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                    "scheduler": trainer.lr_scheduler.state_dict(), "log_history": trainer.state.log_history},
                   os.path.join(args.save_final, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
