"""How a job stops: pre-emption signals agreed by every rank, faults every rank detects together, and
the word to an elastic Slurm job's batch shell.
"""
