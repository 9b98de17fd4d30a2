"""``python -m k3core.training ...`` is ``k3lab train ...``."""

import sys

from .cli import main

sys.exit(main())
