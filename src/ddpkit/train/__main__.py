"""`python -m ddpkit.train` is `ddpkit train`: the program torchrun starts."""

import argparse
import sys

from .main import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddpkit train", description="the DDP training entrypoint")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
