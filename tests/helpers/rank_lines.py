"""A stand-in job for `ddpkit logs` tests: every rank prints LINES numbered
lines naming itself (`LINE rank=R n=K`), then exits 0."""

import os

LINES = 5

if __name__ == "__main__":
    rank = os.environ["RANK"]
    for n in range(1, LINES + 1):
        print(f"LINE rank={rank} n={n}", flush=True)
