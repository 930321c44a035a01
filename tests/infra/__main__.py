"""``python -m tests.infra``: install, start, stop and show the integration-test servers."""

from __future__ import annotations

import sys

from tests.infra.cli import main

sys.exit(main())
