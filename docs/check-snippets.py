#!/usr/bin/env python3
"""Check that the code snippets of the documentation are the code the SDK tests check.

A snippet is marked in the Markdown by a comment on the line before its code fence:

    <!-- snippet: sdk/python/examples/minimal_agent.py -->
    ```python
    ...
    ```

The block must be the named file, or a run of whole consecutive lines of it (an
excerpt). The SDKs' run-tests.sh call this with their own directory, so that only the
snippets taken from that SDK are checked there:

    docs/check-snippets.py sdk/python        # every snippet taken from sdk/python/
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [*sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "sdk").glob("*/README.md"))]
MARKED = re.compile(r"^<!-- snippet: (\S+) -->\n```[\w-]*\n(.*?)^```$", re.M | re.S)


def main(prefixes: list[str]) -> int:
    checked, failures = 0, []
    for page in PAGES:
        text = page.read_text()
        if text.count("<!-- snippet:") != len(MARKED.findall(text)):
            failures.append(f"{page.relative_to(REPO)}: a snippet marker not followed by a code fence")
        for source, block in MARKED.findall(text):
            if prefixes and not any(source.startswith(p.rstrip("/") + "/") for p in prefixes):
                continue
            checked += 1
            path = REPO / source
            where = f"{page.relative_to(REPO)}: the snippet from {source}"
            if not path.is_file():
                failures.append(f"{where}: no such file")
                continue
            lines = path.read_text().splitlines()
            want = block.splitlines()
            if not any(lines[i : i + len(want)] == want for i in range(len(lines) - len(want) + 1)):
                failures.append(f"{where} is not the file, nor consecutive lines of it")
    for failure in failures:
        print(f"check-snippets: {failure}", file=sys.stderr)
    print(f"check-snippets: {checked} snippets checked, {len(failures)} differ", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
