"""Where the Jinja templates the package ships are found: inside the wheel
as ddpkit/templates (pyproject's force-include), in a source checkout at the
repository root. A leaf: the renderer and the report page both read it."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def default_template_dir() -> Path:
    """Templates ship inside the wheel as ddpkit/templates; in a source
    checkout they live at the repository root."""
    packaged = resources.files("ddpkit") / "templates"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[3] / "templates"
