"""ddpkit: one PyTorch DDP job, described once, run on Slurm, Kubernetes, SSH or compose."""

__version__ = "0.1.0"
