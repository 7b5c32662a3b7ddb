"""The install instructions work without a package index (issue 24).

The packages are not on a public index yet, so ``pip install multimodal-fsdp`` fails. The
getting-started page and each package README install torch first, then the packages
from a source checkout, in dependency order (pip looks a missing dependency up on the
index); no page tells a reader to install one of them by name from an index.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Bottom layer first.
LAYERS = ("fsdp-core", "multimodal-fsdp", "model-deepseek-v41")
#: Each page and the layers it installs.
PAGES = {
    "docs/getting-started.md": LAYERS,
    "docs/deepseek-v41.md": LAYERS,
    "packages/fsdp-core/README.md": LAYERS[:1],
    "packages/multimodal-fsdp/README.md": LAYERS[:2],
    "packages/model-deepseek-v41/README.md": LAYERS,
}
_COMMAND = re.compile(r"^\s*pip install (?P<args>.+?)\s*(#.*)?$", re.MULTILINE)


def _installs(page: str) -> list[str]:
    """The arguments of every ``pip install`` line of ``page``, in order."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return [match["args"] for match in _COMMAND.finditer(text)]


@pytest.mark.parametrize(("page", "layers"), PAGES.items())
def test_install_from_a_source_checkout_in_dependency_order(
    page: str, layers: tuple[str, ...]
) -> None:
    commands = _installs(page)
    paths = [f"./packages/{layer}" for layer in layers]
    first = [next((i for i, c in enumerate(commands) if path in c), -1) for path in paths]
    assert -1 not in first, f"{page}: no pip install of {paths} from a checkout: {commands}"
    assert first == sorted(first), f"{page}: {paths} not installed in this order: {commands}"
    text = (ROOT / page).read_text(encoding="utf-8")
    assert "not on a public" in text, page
    if page != "docs/deepseek-v41.md":  # it links to getting-started for the rest
        assert "git clone" in text, page
        torch = next((i for i, c in enumerate(commands) if c.split()[0] == "torch"), -1)
        assert torch != -1, f"{page}: no pip install torch: {commands}"
        assert torch < first[0], f"{page}: torch is not installed first: {commands}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_no_page_installs_a_layer_from_an_index(page: str) -> None:
    for command in _installs(page):
        for argument in command.split():
            name = re.split(r"[\[<>=]", argument.strip("'\""), maxsplit=1)[0]
            assert name not in LAYERS, f"{page}: pip install {command} needs a package index"
