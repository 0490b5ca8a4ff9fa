"""`python -m pipedp ...` is the `pipedp` command."""

import sys

from .cli.main import main

sys.exit(main())
