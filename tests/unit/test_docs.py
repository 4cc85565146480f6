"""The documentation's relative links resolve, and README.md's first screen stays short.

Pages checked: README.md, docs/*.md, tests/README.md, benchmarks/README.md and every README.md under mindspeed_llm/.
A link is `[text](target)` or `![alt](target)` or a reference definition `[name]: target`, outside fenced code
blocks and inline code. Links with a scheme (`https:`, `mailto:`) are not followed. A relative target must exist
(file or folder, relative to the page); a `#anchor` on a Markdown target (or alone, for the page itself) must be
the slug of one of its headings, by GitHub's rule: the heading's text lowercased, everything that is not a letter,
digit, space, `-` or `_` dropped, spaces turned into `-`; a repeated slug gets `-1`, `-2`, ... in order. An explicit
`<a id="...">` / `<a name="...">` also counts.

README.md's first screen is every line above the first line that is exactly `---` (outside code fences; a blank
line above it, so that it renders as a rule and not as a heading underline). It must exist and be at most
FIRST_SCREEN_LINES lines: what the project is, where it is verified, requirements, quick start, models and stages,
one iteration's data flow and the links to the rest.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_SCREEN_LINES = 60

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_pages() -> List[Path]:
    pages = [ROOT / "README.md", ROOT / "tests" / "README.md", ROOT / "benchmarks" / "README.md"]
    pages += sorted((ROOT / "docs").glob("*.md"))
    pages += sorted((ROOT / "mindspeed_llm").rglob("README.md"))
    return [p for p in pages if p.is_file()]


def prose_lines(text: str) -> List[Tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker:
            if fence is None:
                fence = marker.group(1)[0] * len(marker.group(1))
                continue
            if stripped.startswith(fence):
                fence = None
                continue
        if fence is None:
            out.append((number, line))
    return out


def github_slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    found, seen = set(), {}
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path) -> List[Tuple[int, str]]:
    out = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        reference = REFERENCE.match(line)
        if reference:
            out.append((number, reference.group(1)))
            continue
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            out.append((number, target))
    return out


def broken_links(path: Path, anchor_cache: Dict[Path, set] = None) -> List[str]:
    anchor_cache = {} if anchor_cache is None else anchor_cache
    problems = []
    for number, target in links(path):
        if SCHEME.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT) if ROOT in path.parents else path}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor and resolved.suffix == ".md" and resolved.is_file():
            if resolved not in anchor_cache:
                anchor_cache[resolved] = anchors(resolved)
            if anchor not in anchor_cache[resolved]:
                problems.append(f"{where}: no heading with the anchor #{anchor}")
    return problems


def first_screen(text: str) -> List[str]:
    """README.md's lines above its first `---` rule (see the module docstring); None when it has none."""
    lines = text.splitlines()
    for number, line in prose_lines(text):
        if line.strip() == "---" and number >= 2 and lines[number - 2].strip() == "":
            return lines[: number - 1]
    return None


def test_every_relative_link_resolves():
    cache: Dict[Path, set] = {}
    problems = [problem for page in doc_pages() for problem in broken_links(page, cache)]
    assert problems == [], "\n".join(problems)


def test_readme_first_screen_is_at_most_60_lines():
    screen = first_screen((ROOT / "README.md").read_text(encoding="utf-8"))
    assert screen is not None, "README.md needs a line that is only `---` (a blank line above it) to end its first screen"
    assert len(screen) <= FIRST_SCREEN_LINES, f"README.md's first screen is {len(screen)} lines"


def test_readme_quick_start_is_the_two_commands():
    screen = "\n".join(first_screen((ROOT / "README.md").read_text(encoding="utf-8")) or [])
    assert "bash scripts/demo.sh" in screen and "bash scripts/test.sh" in screen


@pytest.mark.parametrize("heading, slug", [
    ("Training state in host memory (offload)", "training-state-in-host-memory-offload"),
    ("From MindSpeed-RL / MindSpeed-LLM", "from-mindspeed-rl--mindspeed-llm"),
    ("`vs_trl.py`: `--stage grpo` / `--stage trl_ppo` against TRL 1.12",
     "vs_trlpy---stage-grpo----stage-trl_ppo-against-trl-112"),
    ("The [demo](x.md) page", "the-demo-page"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_a_planted_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#a-section) [ok too](other.md#a-section-1) [self](#page) [web](https://example.com/x)\n"
        "`[in code](missing.md)`\n\n```\n[in a fence](missing.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#no-such) [bad self](#nowhere)\n"
    )
    problems = broken_links(page)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md: no such file", "other.md#no-such: no heading with the anchor #no-such",
        "#nowhere: no heading with the anchor #nowhere",
    ]
