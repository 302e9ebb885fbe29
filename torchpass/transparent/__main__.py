"""``python -m torchpass.transparent SCRIPT ARGS``: the same as ``python -m torchpass.transparent.bootstrap``."""

from __future__ import annotations

import sys

from torchpass.transparent.bootstrap import main

if __name__ == "__main__":
    sys.exit(main())
