"""What both sides of a launch read alike, the renderer and launchers on one side,
the job on its nodes on the other: the facts they agree on (agreed), the
environment variables of the rank contract (envnames), every exit code
(exitcodes), counts in words (wording). Leaves: nothing here imports the rest
of ddpkit, so `ddpkit train` and the agent import them without the renderer."""
