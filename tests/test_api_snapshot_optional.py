"""The API snapshot check of fsdp-core where its optional frameworks are missing.

``fsdp_core.integrations.transformers``, ``.trl`` and ``.accelerate`` import their
framework; the release session checks the snapshot in an environment with the declared
requirements only. There the check leaves those modules' recorded entries alone (and a
rewrite keeps them) instead of failing on the import; everything else is still checked.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Runs ``tools/api_snapshot.py`` with transformers, TRL and accelerate unimportable.
_WITHOUT_FRAMEWORKS = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("transformers", "trl", "accelerate"):
                raise ModuleNotFoundError("No module named " + repr(name), name=name)
            return None

    sys.meta_path.insert(0, Block())
    sys.path.insert(0, {tools!r})
    import api_snapshot
    missing = api_snapshot.optional_modules_missing("fsdp_core")
    print(sorted(missing.items()))
    sys.exit(api_snapshot.main(["--check", "fsdp-core"]))
    """
)


def test_the_check_passes_without_the_frameworks() -> None:
    script = _WITHOUT_FRAMEWORKS.format(tools=str(ROOT / "tools"))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "[('fsdp_core.integrations.accelerate', 'accelerate'), "
        "('fsdp_core.integrations.transformers', 'transformers'), "
        "('fsdp_core.integrations.trl', 'transformers')]"
    ) in result.stdout
    assert "snapshot up to date" in result.stdout
