"""Callbacks for the training frameworks people use most, which a program adds
to its `Trainer` to be stopped the way ddpkit stops a job (ddpkit/preamble/stop.py):
`ddpkit.frameworks.hf.StopCallback` for a Hugging Face Transformers `Trainer`,
`ddpkit.frameworks.lightning.StopCallback` for a Lightning `Trainer`. Each module
imports its framework; nothing else of ddpkit does."""
