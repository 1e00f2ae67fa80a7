"""The DDP training entrypoint (`ddpkit train`, `python -m ddpkit.train`).

Modules: startup/rank_report (how the process was started, who its peers are),
options (flags), models, data, strategy (ddp/dp/split/ZeRO), checkpoint,
signals, evaluate, progress, loop, main. torch is imported inside functions of
main so `ddpkit --help` stays fast.
"""
