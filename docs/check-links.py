#!/usr/bin/env python3
"""Check that every link of the documentation stays in the repository and resolves.

Pages: README.md, docs/*.md and sdk/*/README.md. Every Markdown link (inline
`[text](target)`, reference `[name]: target`, autolink `<scheme:...>`) outside code must
be a relative path to a file or directory of this repository, and a `#fragment` must
name a heading of the target page (GitHub's anchors: lower case, punctuation dropped,
spaces to `-`, `-1`, `-2`... for repeats). A link to a web site or to a path outside the
repository fails: the documentation ships with the code and must not depend on
anything else.

It also checks that LICENSE is the licence every manifest declares (Cargo.toml's
`license`, the SDKs' pyproject.toml and package.json, the OpenAPI documents' `info`).

    docs/check-links.py        # exit 1, listing each bad link, if any
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "sdk").glob("*/README.md")),
]
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
AUTOLINK = re.compile(r"<([a-zA-Z][a-zA-Z0-9+.-]*:[^>\s]*)>")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for title in HEADING.findall(FENCE.sub("", page.read_text())):
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def check(page: Path) -> list[str]:
    text = prose(page.read_text())
    where = page.relative_to(REPO)
    targets = INLINE.findall(text) + REFERENCE.findall(text) + AUTOLINK.findall(text)
    failures = []
    for target in targets:
        if SCHEME.match(target):
            failures.append(f"{where}: {target}: links outside the repository")
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        try:
            resolved.relative_to(REPO)
        except ValueError:
            failures.append(f"{where}: {target}: leaves the repository")
            continue
        if not resolved.exists():
            failures.append(f"{where}: {target}: no such file")
            continue
        if fragment:
            if resolved.suffix != ".md" or not resolved.is_file():
                failures.append(f"{where}: {target}: a fragment on a page that is not Markdown")
            elif fragment not in anchors(resolved):
                failures.append(f"{where}: {target}: no heading #{fragment} in {resolved.name}")
    return failures


#: How each licence's text begins (LICENSE must be the text of the declared licence).
LICENCE_TEXTS = {"Apache-2.0": re.compile(r"^\s*Apache License\s+Version 2\.0, January 2004")}


def check_licence() -> list[str]:
    declared = tomllib.loads((REPO / "Cargo.toml").read_text())["workspace"]["package"]["license"]
    others = {
        "sdk/python/pyproject.toml": tomllib.loads((REPO / "sdk/python/pyproject.toml").read_text())[
            "project"
        ]["license"],
        "sdk/typescript/package.json": json.loads((REPO / "sdk/typescript/package.json").read_text())[
            "license"
        ],
    }
    for name in ("openapi.yaml", "openapi-agent.yaml"):
        found = re.search(r"^\s+identifier:\s*(\S+)", (REPO / "docs" / name).read_text(), re.M)
        others[f"docs/{name}"] = found.group(1) if found else None
    failures = [
        f"{where} declares licence {value}, Cargo.toml {declared}"
        for where, value in others.items()
        if value != declared
    ]
    text = LICENCE_TEXTS.get(declared)
    if text is None or not text.match((REPO / "LICENSE").read_text()):
        failures.append(f"LICENSE is not the text of {declared}, the licence Cargo.toml declares")
    return failures


def main() -> int:
    failures = [f for page in PAGES for f in check(page)] + check_licence()
    for failure in failures:
        print(f"check-links: {failure}", file=sys.stderr)
    print(f"check-links: {len(PAGES)} pages checked, {len(failures)} problems", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
