"""A Hugging Face Trainer job as users write it: a tiny BERT built from a config (no download),
synthetic data, Trainer.train() with checkpoints into TORCHJOBS_CHECKPOINT_DIR, resuming from the
newest `checkpoint-N/` there when it finds one (the usual `get_last_checkpoint` lines of the
Hugging Face examples). `--max-steps N --save-steps K --step-sleep S` (default: one epoch, a
checkpoint every 4 steps, no sleep) make a run long enough to be killed in the middle."""

import argparse
import os
import time

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint


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


class Slow(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"hf-trainer starts at step {state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=-1)
parser.add_argument("--save-steps", type=int, default=4)
parser.add_argument("--step-sleep", type=float, default=0.0)
opts = parser.parse_args()

out = os.environ.get("TORCHJOBS_CHECKPOINT_DIR", "out")
config = BertConfig(
    vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
)
model = BertForSequenceClassification(config)
args = TrainingArguments(
    output_dir=out,
    num_train_epochs=1,
    max_steps=opts.max_steps,
    per_device_train_batch_size=8,
    save_steps=opts.save_steps,
    logging_steps=2,
    report_to=[],
    use_cpu=True,
    dataloader_num_workers=0,
)
last = get_last_checkpoint(out) if os.path.isdir(out) else None
if last and int(os.environ.get("RANK", "0")) == 0:
    print(f"hf-trainer resumed from {os.path.basename(last)}", flush=True)
trainer = Trainer(model=model, args=args, train_dataset=Synthetic(), callbacks=[Slow(opts.step_sleep)])
result = trainer.train(resume_from_checkpoint=last)
print(f"hf-trainer done: steps={result.global_step} loss={result.training_loss:.4f}", flush=True)
