"""A user's own training script in the style of PyTorch's multi-node DDP
tutorial (ddp-tutorial-series, multinode.py): torchrun's variables, a
DistributedSampler, a snapshot every N epochs that a restart loads; changed
only to run on CPU hosts with gloo. It calls nothing of ddpkit.

Test knobs (flags): --step-sleep S per batch (so a test finds it mid-run),
--eval-seconds S of forward-only evaluation after the first epoch,
--final FILE (rank 0 writes the final weights there), --on-stop (the one
line of ddpkit a program adds to be stopped with a snapshot: `ddpkit.on_stop`),
--slow-forward RANK:SECONDS:FROM_STEP (that rank's model sleeps in its forward
from its FROM_STEP-th training step on, as a slower device would).
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class SlowForward(torch.nn.Module):
    """The model, slower in its training forward from one step on (the test knob)."""

    def __init__(self, inner, seconds, from_step):
        super().__init__()
        self.inner, self.seconds, self.from_step, self.calls = inner, seconds, from_step, 0

    def forward(self, x):
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls >= self.from_step:
                time.sleep(self.seconds)
        return self.inner(x)


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, step_sleep):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.step_sleep = step_sleep
        self.steps = 0
        self.epoch = 0
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        time.sleep(self.step_sleep)

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        self.epoch = epoch
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def stop_snapshot(self):
        print(f"stop handler ran after step {self.steps}", flush=True)
        if self.global_rank == 0:
            snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": self.epoch, "STEP": self.steps}
            torch.save(snapshot, self.snapshot_path)

    def evaluate(self, seconds):
        deadline = time.monotonic() + seconds
        with torch.no_grad():
            while time.monotonic() < deadline:
                for source, _ in self.train_data:
                    self.model.module(source)
                    time.sleep(0.01)

    def train(self, max_epochs, eval_seconds):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if epoch == self.epochs_run and eval_seconds:
                self.evaluate(eval_seconds)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def main(args):
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    if args.slow_forward:
        rank, seconds, from_step = args.slow_forward.split(":")
        if int(rank) == int(os.environ["RANK"]):
            model = SlowForward(model, float(seconds), int(from_step))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=args.batch_size, pin_memory=False, shuffle=False,
                        sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer, args.save_every, args.snapshot, args.step_sleep)
    if args.on_stop:
        import ddpkit

        ddpkit.on_stop(trainer.stop_snapshot)
    trainer.train(args.total_epochs, args.eval_seconds)
    if args.final and trainer.global_rank == 0:
        torch.save(trainer.model.module.state_dict(), args.final)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot", default="snapshot.pt")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--eval-seconds", type=float, default=0.0)
    parser.add_argument("--final")
    parser.add_argument("--on-stop", action="store_true")
    parser.add_argument("--slow-forward", metavar="RANK:SECONDS:FROM_STEP")
    main(parser.parse_args())
