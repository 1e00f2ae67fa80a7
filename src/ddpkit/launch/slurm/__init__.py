"""`ddpkit submit slurm`: what the cluster can run, checked before sbatch; submit, follow, and the
queue's state.
"""
