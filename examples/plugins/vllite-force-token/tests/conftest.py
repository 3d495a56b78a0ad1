"""Lets the tests import the package from the source tree when it is not pip-installed.

Discovery is then tested through a throwaway dist-info (see ``test_force_token.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import vllite_force_token  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
