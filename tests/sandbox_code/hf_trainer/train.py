"""A Hugging Face Trainer job as users write it: a tiny BERT built from a config (no download),
synthetic data, Trainer.train() with checkpoints into TORCHJOBS_CHECKPOINT_DIR."""

import os

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Synthetic(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(5, 100, (16,), generator=g)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones(16, dtype=torch.long),
            "labels": int(ids[0] % 2),
        }


config = BertConfig(
    vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
)
model = BertForSequenceClassification(config)
args = TrainingArguments(
    output_dir=os.environ.get("TORCHJOBS_CHECKPOINT_DIR", "out"),
    num_train_epochs=1,
    per_device_train_batch_size=8,
    save_steps=4,
    logging_steps=2,
    report_to=[],
    use_cpu=True,
    dataloader_num_workers=0,
)
trainer = Trainer(model=model, args=args, train_dataset=Synthetic())
result = trainer.train()
print(f"hf-trainer done: steps={result.global_step} loss={result.training_loss:.4f}", flush=True)
