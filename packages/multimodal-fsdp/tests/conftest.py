"""This folder on ``sys.path``: the test modules import the shared toy VLM
(``_mm_toy_vlm``); with ``--import-mode=importlib`` pytest does not add it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
