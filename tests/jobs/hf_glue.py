"""A sequence-classification Trainer script in run_glue.py's shape, written for torchrun by a helper who never saw
trainguard, ported by its Trainer import (tests/test_transformers.py): digits as "sentences" of tokens of varying
length, a word-level tokenizer, a BERT from a config, `train_sampling_strategy="group_by_length"` and dynamic padding,
evaluation and saves every 10 steps, load_best_model_at_end, label smoothing, a cosine schedule with warm-up. Each
rank's batches pad to their own lengths, so each rank counts its own flops between logs (`current_flos`).
"""
import argparse
import json
import os

import sys

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    TrainingArguments,
)
from trainguard.compat.transformers import Trainer

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits_data import load_digits  # noqa: E402  (scikit-learn's digits, without its 2 s import)


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def build_data():
    digits = load_digits()
    images, labels = digits.data.astype(int), digits.target.astype(int)
    sentences = []
    for img in images:
        toks = [f"p{pos}v{val // 4}" for pos, val in enumerate(img) if val > 0]
        sentences.append(" ".join(toks))
    # deterministic split
    rng = np.random.RandomState(0)
    perm = rng.permutation(len(sentences))
    n_train = int(0.8 * len(sentences))
    train_idx, eval_idx = perm[:n_train], perm[n_train:]
    return sentences, labels, train_idx, eval_idx


def build_tokenizer(sentences):
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    for s in sentences:
        for t in s.split():
            if t not in vocab:
                vocab[t] = len(vocab)
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    # no [CLS]/[SEP] post-processor on purpose: with only 45 updates the tiny BERT stays on its
    # initial loss plateau when it has to pool a [CLS] token; pooling the first pixel token learns a bit.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_input_names=["input_ids", "attention_mask"],
    )


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    preds = np.argmax(logits, axis=-1)
    return {"accuracy": float((preds == labels).mean())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--resume", default=None,
                        help="checkpoint path, or 'true' for the latest checkpoint in output_dir")
    parser.add_argument("--num_train_epochs", type=float, default=3)
    cli = parser.parse_args()

    sentences, labels, train_idx, eval_idx = build_data()
    tokenizer = build_tokenizer(sentences)

    def encode(idx):
        enc = tokenizer([sentences[i] for i in idx], truncation=True, max_length=128)
        return ListDataset([
            {"input_ids": enc["input_ids"][k], "attention_mask": enc["attention_mask"][k],
             "labels": int(labels[i])}
            for k, i in enumerate(idx)
        ])

    train_dataset, eval_dataset = encode(train_idx), encode(eval_idx)

    training_args = TrainingArguments(
        output_dir=cli.output_dir,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        gradient_accumulation_steps=2,
        learning_rate=5e-4,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,  # == warmup_ratio=0.1 (warmup_ratio was folded into warmup_steps in transformers 5)
        num_train_epochs=cli.num_train_epochs,
        eval_strategy="steps",
        eval_steps=10,
        save_strategy="steps",
        save_steps=10,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        logging_steps=5,
        label_smoothing_factor=0.1,
        train_sampling_strategy="group_by_length",  # == group_by_length=True in transformers 4
        seed=42,
        dataloader_num_workers=0,
        report_to=[],
        use_cpu=True,
    )

    config = BertConfig(
        vocab_size=tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=10,
        hidden_dropout_prob=0.1,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Trainer re-seeds (seed=42) before model init only if model_init is used; seed here explicitly.
    from transformers import set_seed
    set_seed(training_args.seed)
    model = BertForSequenceClassification(config)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
    )

    resume = cli.resume
    if resume is not None and resume.lower() == "true":
        resume = True
    train_result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()

    if trainer.is_world_process_zero():
        torch.save({"model": trainer.model.state_dict()}, os.path.join(cli.output_dir, "final.pt"))
        with open(os.path.join(cli.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f, indent=1)
        print("train metrics:", train_result.metrics)


if __name__ == "__main__":
    main()
