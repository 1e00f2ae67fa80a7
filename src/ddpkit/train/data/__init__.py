"""Datasets, samplers, loaders and their worker processes, and `ddpkit data` that fetches a dataset."""
