"""`python -m ddpkit.train` is `ddpkit train`: the program torchrun starts."""

import sys

from ..exitcodes import ExitCode
from .argcheck import train_parser, unknown_options_line
from .main import run


def main(argv: list[str] | None = None) -> int:
    parser = train_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        # One line per rank, not the usage once per rank.
        print(unknown_options_line(parser, extras), file=sys.stderr)
        return ExitCode.BAD_INPUT
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
