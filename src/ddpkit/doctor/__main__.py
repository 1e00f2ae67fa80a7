"""`python -m ddpkit.doctor`: what every rendered target runs with --doctor."""

import argparse
import sys

from .main import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddpkit doctor", description="preflight checks and collective benchmark")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
