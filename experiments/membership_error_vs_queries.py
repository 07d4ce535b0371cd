"""Theorem B.1 (W error against queries, the paper's estimator and ours): a thin wrapper of ``headthief reproduce --only theorem-B.1``.

The experiment lives in the package (``headthief.reproduce.claims``) so that an installed headthief runs
it; this script only forwards its arguments (``--quick``, ``--out DIR``, ``--scheduler ...``). The
stand-alone version this replaced is ``git show de4d918:experiments/membership_error_vs_queries.py``.

    .venv/bin/python experiments/membership_error_vs_queries.py [--quick] [--out DIR] [--scheduler serial|processes|tcp://HOST:PORT]
"""

from __future__ import annotations

import sys

from headthief.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return cli_main(["reproduce", "--only", "theorem-B.1", *args])


if __name__ == "__main__":
    sys.exit(main())
