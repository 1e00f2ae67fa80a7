"""The model: building it as stages, and how it is parallelised (DDP, DataParallel and its balanced
variant, model parallel, ZeRO).
"""
