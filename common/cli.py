"""Deprecated: ``python -m common.cli ...``, the entry point before the CLI moved to
``pdserve_cli.py``. Kept for one release: it prints a one-line notice to stderr and runs
``pdserve ...`` with the same arguments. Use ``pdserve ...`` (or ``python -m pdserve_cli ...``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

NOTICE = (
    "DeprecationWarning: 'python -m common.cli' is deprecated and will be removed in the next"
    " release; use 'pdserve' (or 'python -m pdserve_cli')"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the notice, then run ``pdserve_cli.main(argv)``; its exit status."""
    import pdserve_cli

    print(NOTICE, file=sys.stderr, flush=True)
    return pdserve_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
