import os, sys, warnings
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

class RandomTokens(Dataset):
    def __init__(self, size=256, length=16, vocab=100):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (size, length), generator=g)
    def __len__(self): return len(self.ids)
    def __getitem__(self, i): return {"input_ids": self.ids[i], "labels": self.ids[i]}

class Crash(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 5 and int(os.environ.get("RANK", "0")) == 1:
            raise ValueError("Expected input batch_size (8) to match target batch_size (16).")

def main():
    config = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=8, num_train_epochs=3,
                             logging_steps=10, use_cpu=True, report_to=[], ddp_backend="gloo",
                             ddp_find_unused_parameters=True, disable_tqdm=True, save_strategy="no")
    Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[Crash()]).train()

if __name__ == "__main__":
    main()
# ruff: noqa  (kept as it ran: the line numbers in node0.log and node1.log are this file's)
