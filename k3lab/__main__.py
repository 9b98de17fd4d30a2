"""``python -m k3lab COMMAND ...`` is ``k3lab COMMAND ...``."""

import sys

from k3lab.cli import main

sys.exit(main())
