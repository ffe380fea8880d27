"""Tiny masked-language-model pretraining with the Hugging Face Trainer. Written for torchrun by a helper who
never saw trainguard (tests/jobs/hf_mlm_plain.py); ported by importing the Trainer from trainguard.compat.transformers.

Modelled on examples/pytorch/language-modeling/run_mlm.py, but self-contained:
  * a character-level tokenizer is built locally with the `tokenizers` library
    and wrapped in PreTrainedTokenizerFast (no downloads),
  * the corpus is the Python standard library's own .py files,
  * the model is a 2-layer BERT built from a config (random init).

Usage:
  OMP_NUM_THREADS=1 torchrun --nproc-per-node 3 train.py --output_dir out --max_steps 40
  # resume from the last checkpoint in output_dir:
  OMP_NUM_THREADS=1 torchrun --nproc-per-node 3 train.py --output_dir out --max_steps 40 \
      --resume_from_checkpoint latest
"""

import argparse
import glob
import json
import logging
import math
import os
import sys
import sysconfig

import numpy as np
import torch
from torch.utils.data import Dataset

import transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    EarlyStoppingCallback,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from trainguard.compat.transformers import Trainer

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


# --------------------------------------------------------------------------- #
# Arguments
# --------------------------------------------------------------------------- #
def parse_args():
    p = argparse.ArgumentParser(description="Tiny BERT MLM on the Python stdlib")
    p.add_argument("--output_dir", type=str, default="./mlm-out")
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=16)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup_steps", type=int, default=4)
    p.add_argument("--eval_steps", type=int, default=10)
    p.add_argument("--save_steps", type=int, default=10)
    p.add_argument("--logging_steps", type=int, default=5)
    p.add_argument("--save_total_limit", type=int, default=2)
    p.add_argument("--early_stopping_patience", type=int, default=3)
    p.add_argument("--mlm_probability", type=float, default=0.15)
    p.add_argument("--dataloader_num_workers", type=int, default=2)
    p.add_argument("--num_train_files", type=int, default=40)
    p.add_argument("--num_eval_files", type=int, default=4)
    p.add_argument("--max_eval_samples", type=int, default=256)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--resume_from_checkpoint",
        type=str,
        default=None,
        help="Path to a checkpoint, or 'latest' to pick up the last checkpoint in --output_dir.",
    )
    p.add_argument("--overwrite_output_dir", action="store_true")
    return p.parse_args()


# --------------------------------------------------------------------------- #
# Tokenizer (character level, built locally)
# --------------------------------------------------------------------------- #
def build_tokenizer():
    # printable ASCII + whitespace; anything else becomes [UNK]
    chars = sorted(set(chr(i) for i in range(32, 127)) | {"\n", "\t"})
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[c] = len(vocab)

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    # split every character into its own "word"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    )


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #
def read_stdlib_files():
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    texts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    return texts


def group_texts(token_lists, block_size, tokenizer):
    """Concatenate all token ids and split into chunks, like run_mlm.py's group_texts,
    then wrap each chunk as [CLS] chunk [SEP]."""
    concatenated = [t for ids in token_lists for t in ids]
    inner = block_size - 2
    total_length = (len(concatenated) // inner) * inner
    examples = []
    for i in range(0, total_length, inner):
        chunk = concatenated[i : i + inner]
        input_ids = [tokenizer.cls_token_id] + chunk + [tokenizer.sep_token_id]
        examples.append(
            {
                "input_ids": input_ids,
                "attention_mask": [1] * len(input_ids),
                "special_tokens_mask": [1] + [0] * len(chunk) + [1],
            }
        )
    return examples


class CodeDataset(Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        return self.examples[idx]


def make_datasets(tokenizer, args):
    texts = read_stdlib_files()
    train_texts = texts[: args.num_train_files]
    eval_texts = texts[args.num_train_files : args.num_train_files + args.num_eval_files]

    def tokenize(batch):
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in batch]

    train_examples = group_texts(tokenize(train_texts), args.block_size, tokenizer)
    eval_examples = group_texts(tokenize(eval_texts), args.block_size, tokenizer)
    if args.max_eval_samples is not None:
        eval_examples = eval_examples[: args.max_eval_samples]
    return CodeDataset(train_examples), CodeDataset(eval_examples)


# --------------------------------------------------------------------------- #
# Metrics (same as run_mlm.py)
# --------------------------------------------------------------------------- #
def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):
        # Depending on the model and config, logits may contain extra tensors,
        # like past_key_values, but logits always come first
        logits = logits[0]
    return logits.argmax(dim=-1)


def compute_metrics(eval_preds):
    preds, labels = eval_preds
    labels = labels.reshape(-1)
    preds = preds.reshape(-1)
    mask = labels != -100
    labels = labels[mask]
    preds = preds[mask]
    return {"accuracy": float((preds == labels).mean()) if labels.size else 0.0}


# --------------------------------------------------------------------------- #
# Callbacks
# --------------------------------------------------------------------------- #
class JsonLoggingCallback(TrainerCallback):
    """Append every log record (plus perplexity for eval records) to a jsonl file."""

    def __init__(self, path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or logs is None:
            return
        record = dict(logs)
        record["step"] = state.global_step
        if "eval_loss" in record:
            try:
                record["eval_perplexity"] = math.exp(record["eval_loss"])
            except OverflowError:
                record["eval_perplexity"] = float("inf")
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            logger.info(
                "Training finished at step %d; best checkpoint: %s (%s=%s)",
                state.global_step,
                state.best_model_checkpoint,
                args.metric_for_best_model,
                state.best_metric,
            )


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #
def main():
    args = parse_args()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    log_level = logging.INFO if local_rank in (-1, 0) else logging.WARNING
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type="cosine",
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        greater_is_better=True,
        logging_steps=args.logging_steps,
        seed=args.seed,
        dataloader_num_workers=args.dataloader_num_workers,
        report_to="none",
        use_cpu=True,
    )

    # Detecting last checkpoint (as in run_mlm.py)
    last_checkpoint = None
    if os.path.isdir(args.output_dir) and not args.overwrite_output_dir:
        last_checkpoint = get_last_checkpoint(args.output_dir)
        if last_checkpoint is not None and args.resume_from_checkpoint is None:
            logger.info(
                "Checkpoint detected at %s. Pass --resume_from_checkpoint latest to resume, "
                "or --overwrite_output_dir to train from scratch.",
                last_checkpoint,
            )

    # Set seed before initializing model.
    set_seed(training_args.seed)

    tokenizer = build_tokenizer()
    with training_args.main_process_first(desc="building dataset"):
        train_dataset, eval_dataset = make_datasets(tokenizer, args)
    logger.info("train blocks: %d, eval blocks: %d", len(train_dataset), len(eval_dataset))

    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=args.block_size,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = BertForMaskedLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("Training new model from scratch - Total size=%.2fK params", n_params / 1e3)

    data_collator = DataCollatorForLanguageModeling(
        tokenizer=tokenizer,
        mlm_probability=args.mlm_probability,
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        callbacks=[
            EarlyStoppingCallback(early_stopping_patience=args.early_stopping_patience),
            JsonLoggingCallback(os.path.join(args.output_dir, "train_log.jsonl")),
        ],
    )

    # Training
    checkpoint = None
    if args.resume_from_checkpoint is not None:
        if args.resume_from_checkpoint.lower() in ("latest", "last", "true"):
            checkpoint = last_checkpoint
            if checkpoint is None:
                logger.warning("No checkpoint found in %s; training from scratch.", args.output_dir)
        else:
            checkpoint = args.resume_from_checkpoint
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()  # saves the tokenizer too for easy upload

    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    # Evaluation
    logger.info("*** Evaluate ***")
    metrics = trainer.evaluate()
    metrics["eval_samples"] = len(eval_dataset)
    try:
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
    except OverflowError:
        metrics["perplexity"] = float("inf")
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
