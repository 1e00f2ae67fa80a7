"""The documentation site's reference pages, generated from the code they
describe: the job spec's fields (its JSON Schema), the commands and flags
(the CLI's parser), the exit codes (ddpkit.shared.exitcodes) and the environment
variables (ddpkit.shared.envnames). `pages(root)` returns each page's Markdown;
mkdocs_hook adds them to the site when `mkdocs build` runs, so they are
never files in docs/ that could drift."""

from __future__ import annotations

from pathlib import Path

from .cli_page import cli_page
from .owners_pages import environment_page, exit_codes_page
from .spec_page import spec_page


def pages(root: Path) -> dict[str, str]:
    """{path under docs/: Markdown} for every generated page; `root` is the
    checkout whose examples/, README.md and docs/ give the spec's examples."""
    return {
        "reference/spec.md": spec_page(root),
        "reference/cli.md": cli_page(),
        "reference/exit-codes.md": exit_codes_page(),
        "reference/environment.md": environment_page(),
    }
