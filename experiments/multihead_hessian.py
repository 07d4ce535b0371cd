"""Appendix C's conjecture (success rate of the Hessian route against d, H and precision): a thin wrapper of ``headthief reproduce --only conjecture-C``.

The experiment lives in the package (``headthief.reproduce.claims``) so that an installed headthief runs
it; this script only forwards its arguments (``--quick``, ``--out DIR``, ``--scheduler ...``). The
stand-alone version this replaced is ``git show de4d918:experiments/multihead_hessian.py``.

    .venv/bin/python experiments/multihead_hessian.py [--quick] [--out DIR] [--scheduler serial|processes|tcp://HOST:PORT]
"""

from __future__ import annotations

import sys

from headthief.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return cli_main(["reproduce", "--only", "conjecture-C", *args])


if __name__ == "__main__":
    sys.exit(main())
