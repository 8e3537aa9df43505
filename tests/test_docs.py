"""The documentation holds together: the README is a short front door, docs/README.md indexes every
page under docs/ and every report the benchmarks wrote under benchmarks/results/, every relative
link (and its #anchor) leads somewhere, and the guides carry no change history. Reads files only:
no processes, no torch, no import of benchmarks/."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REPORTS = ROOT / "benchmarks" / "results"   # the generated pages: benchmarks/' output, not docs/
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _pages() -> List[Path]:
    return sorted([ROOT / "README.md", *DOCS.rglob("*.md"), *REPORTS.rglob("*.md")])


def _links(path: Path) -> List[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading.

    >>> _slug("## `compression=gc.Auto()`: a road per bucket, measured")
    'compressiongcauto-a-road-per-bucket-measured'
    """
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> Set[str]:
    seen: Dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if line.startswith("#"):
            slug = _slug(line)
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_a_short_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into a docs/ page"
    assert any("pip install" in ln for ln in lines[:40]), "README.md: say how to install in its first 40 lines"


def test_docs_index_links_every_page() -> None:
    index = DOCS / "README.md"
    linked = {(DOCS / target.split("#")[0]).resolve() for target in _links(index) if "://" not in target}
    pages = {p.resolve() for p in [*DOCS.rglob("*.md"), *REPORTS.rglob("*.md")]} - {index.resolve()}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert not missing, f"docs/README.md does not link {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page: Path) -> None:
    broken: List[Tuple[str, str]] = []
    for target in _links(page):
        if "://" in target or target.startswith("mailto:"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page.resolve()
        if not dest.exists():
            broken.append((target, "no such file"))
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append((target, "no such heading"))
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def _guides() -> List[Path]:
    """The pages docs/README.md lists under *Guides* (generated reports may name the defaults
    they were measured with; guides describe the code as it is)."""
    text = (DOCS / "README.md").read_text()
    section = text.split("## Guides", 1)[1].split("\n## ", 1)[0]
    return [DOCS / t for t in LINK.findall(section)] + [ROOT / "README.md"]


HISTORY = re.compile(r"found and fixed|before the fix|\bissue \d+|\bsession \d+|until this version|used to sit",
                     re.I)


def test_guides_carry_no_change_history() -> None:
    found = []
    for page in _guides():
        if not page.exists():
            continue   # reported by the link test
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{page.relative_to(ROOT)}:{n}: {line.strip()[:80]}")
    assert not found, "change history belongs in git log:\n" + "\n".join(found)


def test_no_two_pages_share_a_title() -> None:
    titles: Dict[str, List[str]] = {}
    for page in [*DOCS.rglob("*.md"), *REPORTS.rglob("*.md")]:
        first = page.read_text().splitlines()[:1]
        titles.setdefault(first[0] if first else "", []).append(str(page.relative_to(ROOT)))
    assert not {t: ps for t, ps in titles.items() if len(ps) > 1}


def test_the_codec_walkthrough_is_the_plugins_own_code() -> None:
    """docs/WRITING_A_CODEC.md walks through tests/plugins/sign_plugin: every code block of the page
    is in the plugin's source (or its pyproject.toml) as it is, so the page cannot drift from the file
    its tests run."""
    page = (DOCS / "WRITING_A_CODEC.md").read_text()
    plugin = ROOT / "tests" / "plugins" / "sign_plugin"
    sources = {"python": (plugin / "hvdgc_sign_plugin" / "__init__.py").read_text(),
               "toml": (plugin / "pyproject.toml").read_text()}
    blocks = re.findall(r"^```(python|toml)\n(.*?)^```", page, re.S | re.M)
    assert len(blocks) >= 7
    for lang, code in blocks:
        assert code in sources[lang], f"this {lang} block of WRITING_A_CODEC.md is not in the plugin:\n{code}"
