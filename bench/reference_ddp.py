"""The reference loop: DDP training the way the source documents (shared/seeds/)
write it, as a plain script a reader of those posts would run with torchrun.

fp32, per-sample torchvision transforms on PIL images in a DataLoader with
worker processes, DistributedSampler, DDP, and evaluation on rank 0 only.
The data is torchvision's FakeData (no download is possible here); it yields
PIL images like CIFAR10/ImageFolder do, so the same transforms run.

The only addition is --timing: rank 0 appends {"step", "time"} lines so the
benchmark can compute images/s the same way it does for ddpkit.

  torchrun --nproc_per_node=2 bench/reference_ddp.py --model resnet18 --image-size 32
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="resnet18")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--num-classes", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--train-size", type=int, default=1024)
parser.add_argument("--eval-size", type=int, default=256)
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--log-every", type=int, default=10)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--timing", help="rank 0 appends JSON lines {step, time} here")
args = parser.parse_args()

# torchrun sets these
rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
if args.device == "cuda":
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")

# model: torchvision ResNet; small inputs get the usual CIFAR stem
model = getattr(torchvision.models, args.model)(num_classes=args.num_classes)
if args.image_size <= 64:
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
model = model.to(device)
model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

# data: per-sample transforms in the workers
normalize = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
if args.image_size <= 64:
    train_tf = T.Compose([T.RandomCrop(args.image_size, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
else:
    train_tf = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
test_tf = T.Compose([T.ToTensor(), normalize])
size = (3, args.image_size, args.image_size)
train_set = torchvision.datasets.FakeData(args.train_size, size, args.num_classes, transform=train_tf, random_offset=0)
test_set = torchvision.datasets.FakeData(args.eval_size, size, args.num_classes, transform=test_tf, random_offset=10**6)
sampler: DistributedSampler[tuple[torch.Tensor, int]] = DistributedSampler(train_set)
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=device.type == "cuda", drop_last=True)
test_loader = DataLoader(test_set, batch_size=args.batch_size, num_workers=args.workers)

criterion = nn.CrossEntropyLoss().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
# Kept open for the whole run and closed at exit: the script stays as plain as a tutorial's.
timing = open(args.timing, "a") if args.timing and rank == 0 else None  # noqa: SIM115

step, epoch = 0, 0
model.train()
while step < args.steps:
    sampler.set_epoch(epoch)
    for images, labels in train_loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = criterion(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.log_every == 0 and rank == 0:
            value = loss.item()
            print(f"epoch {epoch} step {step} loss {value:.4f}", flush=True)
            if timing:
                timing.write(json.dumps({"step": step, "time": time.time(), "loss": value}) + "\n")
                timing.flush()
        if step == args.steps:
            break
    epoch += 1

# evaluation on rank 0 only (the other ranks wait at the barrier)
if rank == 0:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in test_loader:
            images, labels = images.to(device), labels.to(device)
            correct += (model.module(images).argmax(1) == labels).sum().item()
            total += labels.numel()
    print(f"accuracy {correct / total:.4f}", flush=True)
dist.barrier()
dist.destroy_process_group()
