"""``python -m bridge``: see :mod:`bridge.cli`."""

from __future__ import annotations

import signal
import sys


def _stopped(signum: int, frame: object) -> None:
    sys.stderr.write("python -m bridge: stopped by SIGTERM during start-up\n")
    raise SystemExit(143)


signal.signal(signal.SIGTERM, _stopped)  # while the imports run; bridge.cli then takes SIGTERM over

from .cli import main  # noqa: E402

sys.exit(main())
