"""The documentation: README.md (the landing page) and the site under docs/ (mkdocs.yml), checked on the source.

- Every link in README.md and in docs/ resolves: a relative path exists, and its `#anchor` is a heading of the
  target Markdown file (a heading of a file it includes, or an API object a `::: name` block renders, counts);
  an http(s) link is well-formed. Links inside code are not links.
- mkdocs.yml's navigation and docs/ agree: every page in the nav exists, and every docs page is in the nav.
- Measured figures are included from bench/, never copied: no row of bench/results/perf.md appears in a page.
- bench/README.md indexes every benchmark script in its group's section, and every bench/ path that a page, the
  README, a docstring or a test names exists.

`make docs` (and .ci/run) builds the site with `mkdocs build --strict`, which also checks the API references;
the slow test here runs the same build into a temporary folder, or reads the one .ci/run has just made
($SLMVIZ_BUILT_SITE).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
BENCH = REPO / "bench"

FENCE = re.compile(r"^ {0,4}(```|~~~).*?^ {0,4}\1", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
INCLUDE = re.compile(r"\{%\s*include-markdown\s+\"([^\"]+)\"[^%]*%\}")
AUTODOC = re.compile(r"^:::\s+(\S+)", re.M)


def prose(text: str) -> str:
    """The Markdown without code blocks, inline code and the YAML front matter (none of them hold links)."""
    if text.startswith("---\n"):
        text = text[text.index("\n---", 4) + 4:]
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text(encoding="utf-8")))


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's toc slugify, which MkDocs uses for heading ids."""
    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def github_slug(heading: str) -> str:
    """GitHub's heading anchors: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def heading_text(raw: str) -> str:
    """A heading as text: links by their text, no emphasis or code marks."""
    raw = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    raw = re.sub(r"(?<!\w)_+|_+(?!\w)", "", raw)  # _emphasis_ marks, not the underscore inside hook_in
    return re.sub(r"[*`]", "", raw)


def anchors(path: Path, seen: frozenset[Path] = frozenset()) -> set[str]:
    """The anchors a Markdown file offers, in both GitHub's and MkDocs' spelling where they agree.

    A heading must give the same anchor on GitHub and on the site to count, so a link works in both; the
    included files' headings and the `::: name` API blocks (site only) count too."""
    text = path.read_text(encoding="utf-8")
    found = set(AUTODOC.findall(text))
    for _, raw in HEADING.findall(FENCE.sub("", text)):
        title = heading_text(raw)
        if mkdocs_slug(title) == github_slug(title):
            found.add(mkdocs_slug(title))
    for include in INCLUDE.findall(text):
        target = (path.parent / include).resolve()
        if target.exists() and target not in seen:
            found |= anchors(target, seen | {path})
    return found


def broken(path: Path, target: str, root: Path = REPO) -> str | None:
    """Why a link in `path` does not resolve, or None when it does (`root`: where links may point)."""
    if target.startswith(("http://", "https://")):
        url = urlparse(target)
        ok = url.scheme in ("http", "https") and "." in url.netloc and " " not in target
        return None if ok else f"malformed URL {target!r}"
    if ":" in target.split("/")[0]:
        return f"{target!r}: only relative paths and http(s) URLs are links here"
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    if not dest.is_relative_to(root):
        return f"{target!r} leaves the repository"
    if not dest.exists():
        return f"{target!r}: {dest.relative_to(root)} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target!r}: no heading with anchor #{anchor} in {dest.relative_to(root)}"
    return None


def doc_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def nav_pages() -> list[str]:
    def walk(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in walk(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in walk(value)]
        return []

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    return walk(config["nav"])


def test_the_link_checker_finds_broken_links(tmp_path):
    """The checks below can fail: a missing file, a missing anchor and a bad URL are each caught."""
    (tmp_path / "a.md").write_text("# Title\n\n## Two words\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("x", encoding="utf-8")
    assert broken(page, "a.md", tmp_path) is None and broken(page, "a.md#two-words", tmp_path) is None
    assert broken(page, "missing.md", tmp_path)
    assert broken(page, "a.md#no-such-heading", tmp_path)
    assert broken(page, "../outside.md", tmp_path)
    assert broken(page, "https://", tmp_path) and broken(page, "http://exa mple.com", tmp_path)
    assert broken(page, "mailto:someone", tmp_path)
    assert links(page) == []
    page.write_text("[a](a.md) `[b](b.md)` ![c](c.png)\n```\n[d](d.md)\n```\n", encoding="utf-8")
    assert links(page) == ["a.md", "c.png"]


def test_readme_links_resolve():
    problems = [why for target in links(README) if (why := broken(README, target))]
    assert not problems, "README.md: " + "; ".join(problems)


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_links_resolve(page):
    problems = [why for target in links(page) if (why := broken(page, target))]
    text = page.read_text(encoding="utf-8")
    problems += [f"includes missing {inc!r}" for inc in INCLUDE.findall(text) if not (page.parent / inc).exists()]
    assert not problems, f"{page.relative_to(REPO)}: " + "; ".join(problems)


def test_nav_and_docs_agree():
    nav = nav_pages()
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    unlisted = [str(p.relative_to(DOCS)) for p in doc_pages() if str(p.relative_to(DOCS)) not in nav]
    assert not unlisted, f"pages in docs/ that mkdocs.yml's nav does not list: {unlisted}"
    assert len(nav) == len(set(nav)), "a page is listed twice in the nav"


def test_readme_is_a_landing_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "README.md is the landing page: move details into docs/"
    assert "Gemma Terms of Use" in text, "the README must mention the Gemma terms the Gemma package bundles"
    assert "docs/getting-started.md" in text


def test_measured_tables_are_included_not_copied():
    """bench/results/perf.md's rows reach the site only through docs/performance.md's include."""
    assert '"../bench/results/perf.md"' in (DOCS / "performance.md").read_text(encoding="utf-8")
    rows = [line for line in (BENCH / "results" / "perf.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| ") and not line.startswith("| ---") and "|" in line[2:]]
    assert rows
    for page in [README, *doc_pages()]:
        text = page.read_text(encoding="utf-8")
        copied = [row for row in rows[1:] if row in text]
        assert not copied, f"{page.relative_to(REPO)} copies bench/results/perf.md rows: {copied[:2]}"


def test_the_bench_index_names_every_script_in_its_group():
    """bench/README.md's section for each group (`## perf/: ...`) names every script in that folder, so a script
    cannot be added unindexed or moved without its line. Does not check what the line says."""
    index = (BENCH / "README.md").read_text(encoding="utf-8")
    sections = {m.group(1): m.group(2) for m in re.finditer(r"^## (\w+)/:[^\n]*\n(.*?)(?=^## |\Z)", index, re.M | re.S)}
    groups = sorted({p.parent.name for p in BENCH.glob("*/*.py")})
    assert groups and set(groups) <= set(sections), f"bench/README.md has no section for {set(groups) - set(sections)}"
    missing = [f"{g}/{p.name}" for g in groups for p in sorted((BENCH / g).glob("*.py"))
               if f"`{p.name}`" not in sections[g]]
    assert not missing, f"bench/README.md does not index {missing}"


BENCH_FILE = re.compile(r"(?<![\w-])bench/[\w./-]+?\.(?:py|md|json|png|txt)\b")


def test_every_bench_path_named_exists():
    """A bench/ file named in the README, a docs page, a result table the docs include, or a docstring or comment of
    the library, the app, the tests or the bench exists: bench/ was regrouped in 0.3, and a stale path sends a
    reader to nothing. Does not cover CHANGELOG.md (its history keeps the paths of the day) or the JSON records."""
    sources = [README, REPO / "mkdocs.yml", *DOCS.rglob("*.md"), *(BENCH / "results").glob("*.md"),
               *BENCH.rglob("*.py"), *(REPO / "slmviz").rglob("*.py"), *(REPO / "app").rglob("*.py"),
               *(REPO / "tests").glob("*.py")]
    stale = sorted({(str(f.relative_to(REPO)), path) for f in sources
                    for path in BENCH_FILE.findall(f.read_text(encoding="utf-8")) if not (REPO / path).exists()})
    assert not stale, f"bench paths that do not exist: {stale[:10]}"


def test_no_file_refers_to_a_design_document_outside_the_repository():
    """The design notes the project started from are not in the repository, so a reference to them in a docstring, a
    test or a page sends a reader nowhere: the docs pages hold what those notes said."""
    name = "DESIGN" + ".md"  # spelled in two parts so this test does not find itself
    sources = [README, *DOCS.rglob("*.md"), *BENCH.rglob("*.py"), *(REPO / "slmviz").rglob("*.py"),
               *(REPO / "app").rglob("*.py"), *(REPO / "tests").glob("*.py")]
    naming = sorted(str(f.relative_to(REPO)) for f in sources if name in f.read_text(encoding="utf-8"))
    assert not naming, f"files that name {name}: {naming}"


def test_the_hand_written_trace_signature_is_current():
    """docs/api/index.md writes out `slmviz.trace`'s signature (the function shadows its module, so mkdocstrings
    cannot render it); a new parameter must reach the page."""
    import inspect

    import slmviz

    params = ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}"
                       for p in inspect.signature(slmviz.trace).parameters.values())
    assert f"slmviz.trace({params}) -> Trace" in (DOCS / "api" / "index.md").read_text(encoding="utf-8")


# The folder that `make docs` has just built from this checkout: .ci/run builds the site first (a failed strict
# build stops CI there) and names it here, so that the test reads that build instead of making the same one again.
BUILT_SITE = os.environ.get("SLMVIZ_BUILT_SITE")


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    """What `make docs` runs: any warning (a broken link, anchor or API reference) fails the build."""
    if BUILT_SITE:
        built = Path(BUILT_SITE)
        assert (built / "index.html").is_file(), f"$SLMVIZ_BUILT_SITE names no built site: {built}"
    else:
        pytest.importorskip("mkdocs", reason='the docs extra is not installed: pip install -e ".[docs]"')
        pytest.importorskip("mkdocstrings")
        done = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
            cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        built = tmp_path / "site"
    assert (built / "assets" / "screenshot-run.png").is_file(), "the screenshots are copied into the site"
    assert 'src="../assets/screenshot-run.png"' in (built / "app" / "index.html").read_text(encoding="utf-8")
    performance = (built / "performance" / "index.html").read_text(encoding="utf-8")
    assert "greedy generate" in performance and "<table>" in performance, "bench/results/perf.md is included"
