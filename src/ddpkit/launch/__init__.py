"""Things that start jobs: ssh fan-out, local, docker, slurm submit."""
