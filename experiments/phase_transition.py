"""Theorem 5.1 / A.2 (the convex program's phase transition beside ALS and the adaptive method): a thin wrapper of ``headthief reproduce --only theorem-5.1``.

The experiment lives in the package (``headthief.reproduce.claims``) so that an installed headthief runs
it; this script only forwards its arguments (``--quick``, ``--out DIR``, ``--scheduler ...``). The
stand-alone version this replaced is ``git show de4d918:experiments/phase_transition.py``.

    .venv/bin/python experiments/phase_transition.py [--quick] [--out DIR] [--scheduler serial|processes|tcp://HOST:PORT]
"""

from __future__ import annotations

import sys

from headthief.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return cli_main(["reproduce", "--only", "theorem-5.1", *args])


if __name__ == "__main__":
    sys.exit(main())
