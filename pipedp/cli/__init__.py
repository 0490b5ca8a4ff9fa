"""The ``pipedp`` command line: ``pipedp train`` and ``pipedp schedule show``.

Layer 5 (top): may import every layer. Importing it loads no torch (``schedule show`` is
pure Python); ``train`` loads the training stack when it runs.
"""

from .main import build_parser, main

__all__ = ["main", "build_parser"]
