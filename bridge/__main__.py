"""``python -m bridge``: see :mod:`bridge.cli`."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
