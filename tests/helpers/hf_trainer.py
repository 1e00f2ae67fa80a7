"""A Hugging Face Transformers `Trainer` script as people write one: a tiny
BERT built from a config (nothing downloaded), a random token data set, CPU
and gloo, DDP through the Trainer's own set-up. It calls nothing of ddpkit.

  python hf_trainer.py OUTPUT_DIR EPOCHS [stop|resume]

With `stop`, the program adds ddpkit's callback (stopped with a checkpoint on a
stop signal) and resumes from the last checkpoint in OUTPUT_DIR, as HF's docs show.
With `resume`, it saves a checkpoint every 10 steps and resumes from the last one
(an elastic job's restart), with no call into ddpkit. The test knob
STEP_SLEEP_S (environment) makes each step that much longer.
"""

import os
import sys
import time

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments


class RandomTokens(Dataset):
    def __init__(self, size=256, length=16, vocab=100):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (size, length), generator=generator)
        self.labels = torch.randint(0, 2, (size,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


class SlowSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))


def main():
    output_dir, epochs = sys.argv[1], float(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else ""
    stop = mode == "stop"
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, num_train_epochs=epochs,
                             save_steps={"stop": 100_000, "resume": 10}.get(mode, 50), logging_steps=10, use_cpu=True,
                             report_to=[], ddp_backend="gloo", disable_tqdm=True, seed=0)
    if not mode:
        Trainer(model=model, args=args, train_dataset=RandomTokens()).train()
        return
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    print(f"resuming from {last}" if last else "starting", flush=True)
    callbacks = [SlowSteps()]
    if stop:
        from ddpkit.frameworks.hf import StopCallback

        callbacks.append(StopCallback())
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
