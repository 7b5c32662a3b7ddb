"""Every ```python example in docs/ runs as written, so the documentation cannot rot.

A page's ```python blocks, in order, are one script: the ``train.py`` a reader
would save. The test writes that script into a temporary working directory and
launches it under ``torchrun --nproc-per-node 2`` (``fsdp_core.testing.run_torchrun``,
with a hard timeout); every rank must exit 0. The harness makes no process group:
the script starts its own (``init_distributed()``) or uses none. Each block keeps its
line numbers from the page (the lines between blocks are blank), so a traceback
points at the Markdown line. A page without a python block is not launched.

One HTML comment on the line before a block changes that:

``<!-- docs-test: skip (reason) -->``
    the block is left out of the page's script; use rarely, always with the reason.
``<!-- docs-test: ranks (N) -->``
    the page's script runs on N ranks instead of 2 (for pages about meshes of more
    dimensions, e.g. ``('dp', 'tp')`` 2x2 on 4); the block stays in the script.

A page whose script imports transformers, peft, lightning or torchtitan is skipped when it is
not installed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fsdp_core.testing import TORCHRUN_ENV, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NPROC = 2
#: Seconds one page may run on 2 ranks (start-up is ~5 s; the slowest page ~60 s).
TIMEOUT_S = 300.0

#: Packages an example may import that the test environment need not have.
OPTIONAL_IMPORTS = (
    "transformers",
    "peft",
    "lightning",
    "torchtitan",
    "trl",
    "accelerate",
    "datasets",
)

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<spec>.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>.+)\)$")
_RANKS = re.compile(r"^ranks\s*\((?P<n>[1-9][0-9]*)\)$")


@dataclass
class Page:
    """One page's python blocks, as the script the test runs."""

    page: str
    nproc: int = NPROC
    lines: list[int] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def script(self) -> str:
        """The blocks in order, each at its own line number of the page."""
        out: list[str] = []
        for line, code in zip(self.lines, self.blocks, strict=True):
            out.extend([""] * (line - 1 - len(out)))
            out.extend(code.splitlines())
        return "\n".join(out) + "\n"


def _blocks(text: str) -> Iterator[tuple[int, str, str, list[str]]]:
    """``(first line, language, code, marker options)`` for each fenced block."""
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, fence, lang = opening["indent"], opening["fence"], opening["lang"].lower()
        previous = next((ln for ln in reversed(lines[:index]) if ln.strip()), "")
        marker = _MARKER.match(previous)
        options = [o.strip() for o in marker["spec"].split(";")] if marker else []
        body: list[str] = []
        index += 1
        while index < len(lines) and not lines[index].strip().startswith(fence):
            line = lines[index]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            index += 1
        yield index - len(body) + 1, lang, "\n".join(body) + "\n", options
        index += 1


def collect(docs: Path = DOCS) -> list[Page]:
    """The pages with at least one python block to run."""
    pages: list[Page] = []
    for path in sorted(docs.rglob("*.md")):
        page = Page(path.relative_to(docs).as_posix())
        for line, lang, code, options in _blocks(path.read_text(encoding="utf-8")):
            if lang not in ("python", "py"):
                continue
            skipped = False
            for option in options:
                skip = _SKIP.match(option)
                ranks = _RANKS.match(option)
                if skip:
                    page.skipped.append(f"line {line}: {skip['reason']}")
                    skipped = True
                elif ranks:
                    page.nproc = int(ranks["n"])
                else:
                    page.problems.append(
                        f"docs/{page.page}:{line}: unknown docs-test option {option!r} "
                        "(the options are 'skip (reason)' and 'ranks (N)': a page's blocks "
                        "are one torchrun script)"
                    )
                    skipped = True
            if not skipped:
                page.lines.append(line)
                page.blocks.append(code)
        if page.blocks or page.problems:
            pages.append(page)
    return pages


PAGES = collect()


def test_the_docs_have_examples() -> None:
    names = {page.page for page in PAGES}
    assert sum(len(page.blocks) for page in PAGES) >= 10, names
    assert {"getting-started.md", "frozen-towers.md", "mixed-precision.md"} <= names


def test_the_block_parser() -> None:
    text = (
        "Intro\n\n```python\na = 1\n```\n\n"
        "```bash\ntorchrun x.py\n```\n\n<!-- docs-test: skip (needs GPUs) -->\n"
        "```python\nimport nothing\n```\n\n- a list item:\n\n    ```python\n    c = 3\n    ```\n"
    )
    blocks = list(_blocks(text))
    assert [(line, lang, code) for line, lang, code, _ in blocks] == [
        (4, "python", "a = 1\n"),
        (8, "bash", "torchrun x.py\n"),
        (13, "python", "import nothing\n"),
        (19, "python", "c = 3\n"),
    ]
    assert blocks[2][3] == ["skip (needs GPUs)"]


def test_a_page_script_keeps_the_line_numbers(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text(
        "# T\n\n```python\na = 1\n```\n\ntext\n\n<!-- docs-test: skip (why) -->\n"
        "```python\nnope\n```\n\n```python\nb = a + 1\n```\n"
    )
    (page,) = collect(tmp_path)
    script = page.script().splitlines()
    assert script[3] == "a = 1"
    assert script[14] == "b = a + 1"
    assert "nope" not in script
    assert page.skipped == ["line 11: why"]


def test_a_ranks_marker_sets_the_page_s_ranks_and_keeps_its_block(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text(
        "<!-- docs-test: ranks (4) -->\n```python\na = 1\n```\n\n```python\nb = 2\n```\n"
    )
    (page,) = collect(tmp_path)
    assert (page.nproc, page.blocks, page.problems) == (4, ["a = 1\n", "b = 2\n"], [])
    (tmp_path / "page.md").write_text("```python\na = 1\n```\n")
    assert collect(tmp_path)[0].nproc == NPROC


@pytest.mark.parametrize("bad", ["world_size=4", "gloo", "continue", "skip", "ranks (0)", "ranks"])
def test_an_unknown_marker_is_refused(tmp_path: Path, bad: str) -> None:
    (tmp_path / "page.md").write_text(f"<!-- docs-test: {bad} -->\n```python\na = 1\n```\n")
    (page,) = collect(tmp_path)
    assert "unknown docs-test option" in page.problems[0]


@pytest.mark.distributed
@pytest.mark.parametrize("page", PAGES, ids=[page.page for page in PAGES])
def test_docs_page_runs_under_torchrun(
    page: Page, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not page.problems, "\n".join(page.problems)
    script = page.script()
    for optional in OPTIONAL_IMPORTS:
        if re.search(rf"^\s*(import|from)\s+{optional}\b", script, re.MULTILINE):
            pytest.importorskip(optional)
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / f"docs-{Path(page.page).stem}.py"  # never shadows a module
    path.write_text(script, encoding="utf-8")
    run_torchrun(path.name, nproc=page.nproc, timeout_s=TIMEOUT_S)


def _public_modules(package_dir: Path) -> list[str]:
    """Public modules of a package, from its source tree (no import needed)."""
    src = package_dir / "src"
    modules = []
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and not any(part.startswith("_") for part in parts):
            modules.append(".".join(parts))
    return modules


@pytest.mark.parametrize("package", ["fsdp-core", "multimodal-fsdp", "model-deepseek-v41"])
def test_api_pages_cover_every_public_module(package: str) -> None:
    page = (DOCS / "api" / f"{package}.md").read_text(encoding="utf-8")
    rendered = set(re.findall(r"^:::\s*([\w.]+)", page, re.MULTILINE))
    modules = _public_modules(ROOT / "packages" / package)
    missing = [m for m in modules if m not in rendered]
    assert not missing, f"docs/api/{package}.md has no '::: module' entry for {missing}"
