"""The README and docs/ stand alone: a short README, links and #anchors that resolve, nothing outside the tree.

Anchors are GitHub's heading slugs: the heading's text without markup, lowercased, every character
but letters, digits, `_`, `-` and spaces dropped, spaces turned into `-`; a repeated heading gets
`-1`, `-2`, ... Code blocks and code spans are not Markdown, so links and headings inside them do
not count.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)
EXTERNAL = ("http://", "https://", "mailto:")


def _without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def _prose(text: str) -> str:
    """The text links are read from: no fenced blocks, no code spans."""
    return CODE_SPAN.sub("", _without_code_blocks(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text."""
    text = LINK.sub(r"\1", heading)  # a link in a heading counts by its text
    text = CODE_SPAN.sub(r"\2", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # emphasis `*` goes too; `_` stays (snake_case)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every #anchor a link into `page` may use."""
    text = page.read_text()
    found: set[str] = set(HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for _, heading in HEADING.findall(_without_code_blocks(text)):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def links(page: Path) -> list[str]:
    return [target for _, target in LINK.findall(_prose(page.read_text()))]


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_slugs_follow_githubs_rule() -> None:
    assert slug("A real node (`TRIPTYCH_REAL_NODE=1`): the end-to-end tests") == (
        "a-real-node-triptych_real_node1-the-end-to-end-tests"
    )
    assert slug("`spec.head`") == "spechead"
    assert slug("Running the operator, RBAC") == "running-the-operator-rbac"
    assert slug("**Bold** and [a link](x.md)") == "bold-and-a-link"


def test_the_readme_is_under_the_line_limit() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move detail into docs/ and link to it"
    )


def test_the_readme_starts_with_the_two_commands() -> None:
    """`make setup demo` to try it, `make test` to check it (.ci/run runs `make test`)."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md has no bash block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands[:2] == ["make setup demo", "make test"]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.is_relative_to(REPO):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file {dest.relative_to(REPO)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading in {dest.relative_to(REPO)} has the anchor #{anchor}")
    assert not broken, f"{_name(page)}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_document_points_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    for outside in ("../shared", "/work/shared", "shared/spec"):
        assert outside not in text, f"{_name(page)} mentions {outside!r}: the docs must stand alone"


def test_a_broken_anchor_is_caught(tmp_path: Path) -> None:
    """The checker itself fails on what it is meant to catch."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```bash\n# not a heading\n```\n\n## Real one\n")
    assert anchors(page) == {"title", "real-one"}
    page.write_text("See [x](#missing) and `[y](#in-code)`.\n")
    assert links(page) == ["#missing"]


def _network_policy_texts() -> dict[str, str]:
    """Where the docs say which ports the head's NetworkPolicy opens to the workers."""
    security = (REPO / "docs/security.md").read_text()
    section = security.split("### NetworkPolicies", 1)[1].split("\n## ", 1)[0]
    operator = (REPO / "docs/operator.md").read_text()
    (row,) = [line for line in operator.splitlines() if line.startswith("| NetworkPolicy | `P-head` |")]
    return {"docs/security.md NetworkPolicies": section, "docs/operator.md P-head row": row}


def test_the_network_policy_text_names_every_result_port() -> None:
    """The head's NetworkPolicy opens the result port of each of the pipeline's roles (scheduler port
    +1..+5, triptych.ports); the text that describes it names every one with its role."""
    from triptych.ports import DEFAULT_SCHEDULER_PORT, result_port
    from triptych.roles import ROLE_SPECS

    assert len(ROLE_SPECS) == 5
    for where, text in _network_policy_texts().items():
        flat = " ".join(text.split())
        for role in ROLE_SPECS:
            port = result_port(DEFAULT_SCHEDULER_PORT, role)
            assert f"{port} {role.value}" in flat, f"{where} does not name the result port {port} ({role.value})"
