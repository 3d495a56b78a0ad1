"""A process started in the repository root (``python -c``, ``python -m pytest``: the root is on ``sys.path``) sees
no top-level package named after one of vllite's folders that shadows a real distribution. The kernels folder,
once ``kernels/``, was importable as ``kernels``: the name of Hugging Face's kernels package, which transformers
probes for (``is_kernels_available``) and then imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import importlib.util, json, sys
spec = importlib.util.find_spec("kernels")
from transformers.utils.import_utils import is_kernels_available
available = is_kernels_available()
module = sys.modules.get("kernels")
print(json.dumps({"origin": spec and spec.origin, "available": available,
                  "imported": getattr(module, "__file__", None) if module else None}))
"""


def _probe(cwd: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", _PROBE], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_repository_root_does_not_shadow_the_kernels_package(tmp_path: Path) -> None:
    in_root, elsewhere = _probe(ROOT), _probe(tmp_path)
    for found in (in_root["origin"], in_root["imported"]):
        assert found is None or not Path(found).resolve().is_relative_to(ROOT), in_root
    assert in_root == elsewhere  # transformers' probe answers as it does outside the checkout
