"""Training flags and their validation. No torch import: `--help` stays fast.

Flag names are part of the job specs in examples/ and must not change.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import re
from pathlib import Path

from ...shared.agreed import CHECKPOINT_DIR_FLAG, DEVICES_PER_PROCESS_FLAG, KEEP_GLOBAL_BATCH_FLAG, RESUME_FLAG, STRATEGY_FLAG

MODELS = ("resnet18", "resnet34", "resnet50", "tiny")  # tiny: models.BUILT_IN
FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _whole(text: str, least: int) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= {least}, got {text!r}") from None


def _positive(text: str) -> int:
    value = _whole(text, 1)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = _whole(text, 0)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class DefaultsFormatter(argparse.HelpFormatter):
    """`ddpkit train --help`: each flag's default after its help, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        if default in (None, False, [], argparse.SUPPRESS) or "default" in help_text or not action.option_strings:
            return action.help
        return f"{help_text} (default: %(default)s)".lstrip()


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="resnet18",
                   help="resnet18|resnet34|resnet50 (torchvision), tiny (a few thousand parameters, for smoke runs of "
                        "the plumbing), or package.module:factory called as factory(num_classes=N)")
    g.add_argument("--num-classes", type=_positive, default=10, help="classes of the model's output layer")
    g.add_argument("--image-size", type=_positive, default=32,
                   help="input side in pixels; <= 64 uses the small-image ResNet stem (3x3 conv, no maxpool)")

    g = parser.add_argument_group("data")
    g.add_argument("--data", choices=("synthetic", "cifar10", "imagefolder"), default="synthetic",
                   help="the dataset: random images, CIFAR-10, or an image folder")
    g.add_argument("--data-dir", type=Path,
                   help="cifar10: folder holding cifar-10-batches-py; imagefolder: folder with train/ and val/")
    g.add_argument("--synthetic-size", type=_positive, default=1024, help="number of synthetic training samples")
    g.add_argument("--workers", type=_non_negative, default=2, help="DataLoader workers per process")
    g.add_argument("--gpu-resident-data", action="store_true",
                   help="keep the whole (small) dataset on the device and augment there in batches")

    g = parser.add_argument_group("optimisation")
    g.add_argument("--epochs", type=_positive, default=1, help="passes over the training set")
    g.add_argument("--max-steps", type=_positive, help="stop after this many optimizer steps in total")
    g.add_argument("--batch-size", type=_positive, default=32, help="per process")
    g.add_argument("--lr", type=float, default=0.1, help="learning rate for a global batch of --base-batch; scaled linearly")
    g.add_argument("--base-batch", type=_positive, default=256, help="the global batch --lr is given for")
    g.add_argument("--warmup-epochs", type=float, default=0.0, help="linear warm-up length (fractions allowed)")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    g.add_argument("--grad-accum", type=_positive, default=1,
                   help="micro-batches per optimizer step (no all-reduce on the others)")
    g.add_argument(KEEP_GLOBAL_BATCH_FLAG, dest="keep_global_batch_of", type=_positive, metavar="W",
                   help="elastic: keep the global batch of a W-process job (--batch-size x --grad-accum x W) "
                        "on any world size, by gradient accumulation")
    g.add_argument("--seed", type=int, default=0, help="random seed (model, data order, augmentation)")

    g = parser.add_argument_group("parallelism and speed")
    g.add_argument(STRATEGY_FLAG, choices=("ddp", "dp"), default="ddp",
                   help="ddp: one process per device; dp: DataParallel in one process")
    g.add_argument("--gpu0-batch", type=_non_negative,
                   help="dp: batch size on device 0 (balanced DataParallel); the rest is split evenly")
    g.add_argument(DEVICES_PER_PROCESS_FLAG, type=_positive, default=1,
                   help="split the model over this many devices per process (DDP around model parallel)")
    g.add_argument("--zero", action="store_true", help="shard optimizer state (ZeroRedundancyOptimizer)")
    g.add_argument("--activation-checkpointing", action="store_true", help="recompute each stage's activations in backward")
    g.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (CUDA only)")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="autocast precision (fp16 with a gradient scaler)")
    g.add_argument("--channels-last", action="store_true")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--cudnn-benchmark", action="store_true")

    g = parser.add_argument_group("checkpoints")
    g.add_argument(CHECKPOINT_DIR_FLAG, type=Path)
    g.add_argument("--checkpoint-every", type=_non_negative, default=0,
                   help="steps between checkpoints (0: end of each epoch only)")
    g.add_argument("--keep", type=_positive, default=3, help="keep the last K checkpoints")
    g.add_argument(RESUME_FLAG, help="auto (latest in --checkpoint-dir, if any) or a checkpoint file")

    g = parser.add_argument_group("output")
    g.add_argument("--eval", dest="eval", action="store_true", default=True, help="evaluate after each epoch (default)")
    g.add_argument("--no-eval", dest="eval", action="store_false")
    g.add_argument("--eval-size", type=_positive, default=256, help="synthetic test-set size")
    g.add_argument("--log-dir", type=Path, help="every rank writes rank<R>.log here")
    g.add_argument("--metrics", type=Path, help="JSON Lines file rank 0 appends metrics to")
    g.add_argument("--tensorboard", type=Path, metavar="DIR",
                   help="rank 0 also writes the loss, throughput, per-rank step times and evaluations as "
                        "TensorBoard events into DIR (needs the tensorboard package: ddpkit[tensorboard])")
    g.add_argument("--rank-report-json", metavar="PATH",
                   help="rank 0 writes every process's rank report record here as JSON "
                        "('-': one JSON line per process on stdout)")
    g.add_argument("--rank-report-env", metavar="NAME", action="append", default=[],
                   help="add this environment variable's value, as each process sees it, to its rank report "
                        "record (repeatable)")
    g.add_argument("--log-every", type=_positive, default=10, help="steps between progress lines")
    g.add_argument("--progress", choices=("auto", "bar", "plain"), default="auto",
                   help="auto: a progress bar when stdout is a terminal, plain lines otherwise")


def problems(args: argparse.Namespace) -> list[str]:
    """Every bad combination, each naming the flag and the fix."""
    return static_problems(args) + _local_problems(args)


def _local_problems(args: argparse.Namespace) -> list[str]:
    """What only the node can tell: files on its filesystem."""
    out: list[str] = []
    if args.resume and args.resume != "auto" and not Path(args.resume).is_file():
        out.append(f"--resume {args.resume}: no such file (use auto, or a checkpoint file)")
    if getattr(args, "tensorboard", None) is not None and importlib.util.find_spec("tensorboard") is None:
        out.append(f"--tensorboard {args.tensorboard}: the tensorboard package is not installed here; "
                   "pip install 'ddpkit[tensorboard]' (or drop the flag)")
    report_json = getattr(args, "rank_report_json", None)
    if report_json not in (None, "-") and Path(report_json).is_dir():
        out.append(f"--rank-report-json {report_json}: that is a folder; give a file path (or - for stdout)")
    return out


def static_problems(args: argparse.Namespace) -> list[str]:
    """The bad combinations any machine can tell (argcheck runs them at render time)."""
    out: list[str] = []
    if args.model not in MODELS and not FACTORY_RE.match(args.model):
        close = difflib.get_close_matches(args.model, MODELS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        out.append(f"--model {args.model!r}{hint}: use one of {', '.join(MODELS)} or package.module:factory")
    if args.data in ("cifar10", "imagefolder") and args.data_dir is None:
        out.append(f"--data {args.data} needs --data-dir DIR")
    if args.gpu0_batch is not None and args.strategy != "dp":
        out.append("--gpu0-batch only applies to --strategy dp")
    if args.gpu0_batch is not None and args.gpu0_batch > args.batch_size:
        out.append(f"--gpu0-batch {args.gpu0_batch} is larger than --batch-size {args.batch_size}")
    if args.strategy == "dp" and (args.zero or args.devices_per_process > 1):
        out.append("--strategy dp cannot be combined with --zero or --devices-per-process; use --strategy ddp")
    if args.resume == "auto" and args.checkpoint_dir is None:
        out.append("--resume auto needs --checkpoint-dir DIR")
    if args.checkpoint_every and args.checkpoint_dir is None:
        out.append("--checkpoint-every needs --checkpoint-dir DIR")
    if args.warmup_epochs < 0:
        out.append("--warmup-epochs must be >= 0")
    if args.lr <= 0:
        out.append("--lr must be > 0")
    return out
