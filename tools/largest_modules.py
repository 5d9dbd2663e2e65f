"""A review aid: the largest modules of kvstore/, by lines (issue 35: a module's size is a
reason to look at it, not a rule to split it by).

    python tools/largest_modules.py [N]
"""

from __future__ import annotations

import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kvstore"


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 15
    sizes = sorted(((len(p.read_text(encoding="utf-8").splitlines()), p.relative_to(PKG.parent))
                    for p in PKG.rglob("*.py")), reverse=True)
    for lines, path in sizes[:n]:
        print(f"{lines:6d}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
