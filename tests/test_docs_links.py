"""The documentation holds together: every relative Markdown link in the README, ARCHITECTURE.md and the pages under
docs/, reproduce/, benchmarks/ and examples/ reaches a file or folder of this checkout (and, with an anchor, a
heading of the target, slugged as GitHub does), and the README stays a front door (issue 32, item 3)."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 260

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target may carry a "title" after a space
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _pages() -> list[Path]:
    pages = [REPO / "README.md", REPO / "ARCHITECTURE.md"]
    for folder in ("docs", "reproduce", "benchmarks", "examples"):
        pages += sorted((REPO / folder).rglob("*.md"))
    return [p for p in pages if p.is_file()]


def _prose_lines(text: str, keep_code_spans: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked unless kept (a heading's anchor
    keeps its code spans' text, as GitHub's does)."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            out.append((number, line if keep_code_spans else _CODE_SPAN.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and links reduced to their text, lowercased, punctuation dropped except
    '-' and '_', spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(page.read_text(), keep_code_spans=True):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links() -> list[str]:
    broken, cache = [], {}
    for page in _pages():
        for number, line in _prose_lines(page.read_text()):
            for target in _LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / unquote(path)).resolve() if path else page
                where = f"{page.relative_to(REPO)}:{number}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor.lower() not in cache[dest]:
                        broken.append(f"{where} (no heading '{anchor}' in {dest.relative_to(REPO)})")
    return broken


def test_slug_is_githubs() -> None:
    assert slug("Will my layout fit? (`python -m "
                "nanotron_ext.plan`)") == "will-my-layout-fit-python--m-nanotron_extplan"
    assert slug("Fault-tolerant SparseLoCo (replicas that leave and rejoin, on torchft)") == (
        "fault-tolerant-sparseloco-replicas-that-leave-and-rejoin-on-torchft")
    assert slug("Time to loss (every system over one emulated "
                "WAN)") == "time-to-loss-every-system-over-one-emulated-wan"


def test_the_checker_finds_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Top\n\n[ok](p.md#top) [gone](nowhere.md) `[code](x.md)`\n```\n[fenced](y.md)\n```\n")
    links = [t for _, line in _prose_lines(page.read_text()) for t in _LINK.findall(line)]
    assert links == ["p.md#top", "nowhere.md"]
    assert anchors(page) == {"top"}


def test_every_relative_link_resolves() -> None:
    broken = broken_links()
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_readme_is_a_front_door() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move long sections to docs/"
    assert "[ARCHITECTURE.md](ARCHITECTURE.md)" in "\n".join(lines)
