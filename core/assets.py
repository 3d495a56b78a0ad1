"""Files the project ships: the embedded demo model (trained by ``scripts/train_demo_model.py``)."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"


def default_model_path() -> str:
    """The model used when none is given: the small demo model shipped inside the package."""
    return str(DEMO_MODEL_DIR)
