"""The MkDocs hook (mkdocs.yml `hooks:`) that adds the generated reference
pages to the site's files before the navigation is built, so a strict build
finds them where the nav names them."""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

from ddpkit.docs_reference import pages


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).resolve().parent
    for path, markdown in pages(root).items():
        if files.get_file_from_path(path) is not None:
            raise ValueError(f"docs/{path} is generated from the code: remove the file of that name from docs/")
        files.append(File.generated(config, path, content=markdown))
    return files
