"""What this host is and has, read in one place each: its network interfaces
(netif), its processes through psutil (processes), the job's working directory
(workdir), and what Slurm's scontrol says of its jobs and nodes (scontrol)."""
