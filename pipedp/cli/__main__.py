"""`python -m pipedp.cli ...` is the `pipedp` command."""

import sys

from .main import main

sys.exit(main())
