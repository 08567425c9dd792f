"""`python -m server`: the inference server (see server/cli.py for flags)."""

import sys

from server.cli import main

sys.exit(main())
