"""`python -m ddpkit.agent`: torchrun, with its workers forked from a
pre-imported process instead of started as new interpreters.

Every per-node launch line ddpkit renders runs this in torchrun's place; it
takes torchrun's arguments (and its PET_* defaults) and hands them to
torch.distributed.run, with torch's rendezvous id tagged with the run key
(__main__.parse_args; docs/guides/security.md, threat model). What it adds: before
torchrun starts, while the agent is still single-threaded, it forks a zygote
(zygote.py) that imports torch, torch._dynamo and ddpkit's trainer once;
handler.py routes torchrun's worker starts through it. A worker's start then
costs a fork instead of an interpreter and those imports (about 3
CPU-seconds on the CI machine), paid again by every worker at every restart
of an elastic job (about half of a crashed node's recovery) and by every
test's process.

DDPKIT_AGENT_FORK=0 starts workers as torchrun does (new interpreters; a
program of the user's own under `-m ddpkit.run`, for the preamble a forked
worker gets: ddpkit/preamble). Nothing the zygote imports may initialise
CUDA: zygote.cuda_refusal checks, and the agent falls back where it did.

The agent also tells its launcher, as records on its stderr (ddpkit.records),
what torchrun only logs: a failed worker's exit code (`worker_exit`, from
handler.Watched, forked or not) and where torchrun's own report on it begins
(`agent_report`, __main__.py), which a launcher keeps off its console.
A stop signal (pre-emption, cancel, requeue, Ctrl-C) is a normal end: the
agent waits for its workers through a repeated signal and says how they
ended in one line, without torch's traceback and shutdown warnings (stopping.py).
"""
