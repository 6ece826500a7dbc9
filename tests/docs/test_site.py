"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a page
left out of the navigation or a missing anchor fails it), and every page is in it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs.examples import DOCS, ROOT, examples


@pytest.mark.process
def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "crds" / "index.html").exists()


class _Loader(yaml.SafeLoader):
    """mkdocs.yml's ``!!python/name:`` tags read as nothing (the nav is all we read)."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    return []


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    listed = set(_nav_pages(config["nav"]))
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert pages - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - pages == set(), "nav entries without a page"


def test_the_readme_has_the_two_setup_commands_and_links_that_resolve() -> None:
    readme = ROOT / "README.md"
    commands = [example.code for example in examples(readme) if example.language == "sh"]
    assert commands == ["make agent\n", "make test\n"]
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme.read_text()):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
