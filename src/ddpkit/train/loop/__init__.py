"""The training loop: epochs, one optimizer step, evaluation, and elastic membership on the training
side.
"""
