"""``python -m torchpass``: the same as the ``torchpass`` command."""

from __future__ import annotations

import sys

from torchpass.cli import main

sys.exit(main())
