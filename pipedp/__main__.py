"""`python -m pipedp ...` is the `pipedp` command."""
import sys

from .cli import main

sys.exit(main())
