"""MkDocs hooks of this site (mkdocs.yml `hooks:`): the screenshots in the repository's assets/ become site files.

The browser tests write `assets/*.png` at the repository root, and the README links them there. Pages link them
the same way, relative to their own file (`../assets/screenshot-run.png` from `docs/app.md`), so each link also
resolves on GitHub and in `tests/test_docs.py`. MkDocs only knows files under `docs/`, so `on_files` adds each
PNG as a site file `assets/NAME.png` (copied into the build, never stored twice in git), and `on_page_markdown`
points the page's links at it. Without the rewrite a strict build fails: the link leaves `docs/`.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ASSETS = "assets"
LINK = re.compile(r"(\]\()([^)\s]+)(\))")  # the target of a Markdown link or image: ](target)


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def on_files(files, config):
    """Add every assets/*.png of the repository as the site file assets/NAME.png."""
    root = _root(config)
    for png in sorted((root / ASSETS).glob("*.png")):
        uri = f"{ASSETS}/{png.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File(uri, str(root), config.site_dir, config.use_directory_urls))
    return files


def on_page_markdown(markdown, page, config, files):
    """Rewrite a link that leaves docs/ for the repository's assets/ into a link to the copied site file."""
    page_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("#", "/")):
            return match.group(0)
        resolved = posixpath.normpath(posixpath.join("docs", page_dir, target))  # relative to the repository
        if not resolved.startswith(f"{ASSETS}/"):
            return match.group(0)
        return match.group(1) + posixpath.relpath(resolved, page_dir or ".") + match.group(3)

    return LINK.sub(rewrite, markdown)
