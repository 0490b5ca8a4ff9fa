"""The ``pipedp`` command line: ``pipedp train``, ``pipedp plan``, ``pipedp audit`` and ``pipedp schedule show``.

Layer 5 (top): may import every layer. Importing it loads no torch (``--help`` and ``schedule show`` stay
pure Python); ``train``, ``plan`` and ``audit`` load the training stack when they run.
"""

from .main import build_parser, main

__all__ = ["main", "build_parser"]
