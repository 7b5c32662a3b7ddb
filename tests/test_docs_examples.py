"""Every ```python example in docs/ runs, so the documentation cannot rot.

Each example runs in a fresh namespace, as ``__main__``, in a temporary working
directory, without torchrun variables in the environment, and by default inside
a fresh fake process group of 2 ranks (``fsdp_core.testing.fake_process_group``):
FSDP2 shards exactly as on 2 real ranks, in this one process. An HTML comment
on the line before a block changes that:

``<!-- docs-test: world_size=4 -->``
    a fake group of 4 ranks (any size);
``<!-- docs-test: gloo -->`` (or ``own-group``)
    no group is made; the example starts its own: ``init_distributed()`` starts a
    one-rank gloo group, ``fake_process_group(n)`` a fake one (the test tears down
    whatever is left);
``<!-- docs-test: continue -->``
    the block continues the previous one on the page (same namespace, same run);
``<!-- docs-test: skip (reason) -->``
    not run; use sparingly, with the reason.

Blocks that import transformers or peft are skipped when it is not installed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_core.testing import fake_process_group

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

#: Packages an example may import that the test environment need not have.
OPTIONAL_IMPORTS = ("transformers", "peft")

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<spec>.*?)\s*-->\s*$")
_OPTION = re.compile(r"^(world_size=\d+|gloo|own-group|continue|skip\b.*)$")


@dataclass
class Example:
    """One runnable unit: a python block and the blocks that continue it."""

    page: str
    line: int
    code: str
    world_size: int = 2
    mode: str = "fake"  # "fake" (a group is made for it) or "own" (it makes its own)
    skip: str | None = None
    lines: list[int] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


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
        yield index - len(body), lang, "\n".join(body) + "\n", options
        index += 1


def collect(docs: Path = DOCS) -> list[Example]:
    examples: list[Example] = []
    for path in sorted(docs.rglob("*.md")):
        page = path.relative_to(docs).as_posix()
        last: Example | None = None
        for line, lang, code, options in _blocks(path.read_text(encoding="utf-8")):
            if lang not in ("python", "py"):
                continue
            for option in options:
                if not _OPTION.match(option):
                    raise ValueError(f"{page}:{line}: unknown docs-test option {option!r}")
            if "continue" in options:
                if last is None:
                    raise ValueError(f"{page}:{line}: 'continue' without a block before it")
                last.code += code
                last.lines.append(line)
                continue
            example = Example(page=page, line=line, code=code, lines=[line])
            for option in options:
                if option.startswith("world_size="):
                    example.world_size = int(option.partition("=")[2])
                elif option in ("gloo", "own-group"):
                    example.mode = "own"
                elif option.startswith("skip"):
                    example.skip = option.removeprefix("skip").strip(" ()") or "marked skip"
            examples.append(example)
            last = example
    return examples


EXAMPLES = collect()


def test_the_docs_have_examples() -> None:
    pages = {example.page for example in EXAMPLES}
    assert len(EXAMPLES) >= 10, pages
    assert {"getting-started.md", "frozen-towers.md", "mixed-precision.md"} <= pages


def test_the_block_parser() -> None:
    text = (
        "Intro\n\n<!-- docs-test: world_size=4 -->\n```python\na = 1\n```\n\n"
        "<!-- docs-test: continue -->\n```python\nb = a + 1\n```\n\n"
        "```bash\ntorchrun x.py\n```\n\n<!-- docs-test: skip (needs GPUs) -->\n"
        "```python\nimport nothing\n```\n\n- a list item:\n\n    ```python\n    c = 3\n    ```\n"
    )
    blocks = list(_blocks(text))
    assert [(lang, code) for _, lang, code, _ in blocks] == [
        ("python", "a = 1\n"),
        ("python", "b = a + 1\n"),
        ("bash", "torchrun x.py\n"),
        ("python", "import nothing\n"),
        ("python", "c = 3\n"),
    ]
    assert blocks[0][3] == ["world_size=4"]
    assert blocks[1][3] == ["continue"]
    assert blocks[3][3] == ["skip (needs GPUs)"]


def _run(example: Example, tmp_path: Path) -> None:
    namespace = {"__name__": "__main__", "__file__": str(tmp_path / "example.py")}
    compiled = compile(example.code, f"docs/{example.page}:{example.line}", "exec")
    if example.mode == "fake":
        with fake_process_group(example.world_size):
            exec(compiled, namespace)
    else:
        try:
            exec(compiled, namespace)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_docs_example(example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if example.skip:
        pytest.skip(example.skip)
    for optional in OPTIONAL_IMPORTS:
        if re.search(rf"^\s*(import|from)\s+{optional}\b", example.code, re.MULTILINE):
            pytest.importorskip(optional)
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    assert not dist.is_initialized(), "a process group leaked into this example"
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        _run(example, tmp_path)
    finally:
        torch.set_default_dtype(dtype)
    assert not dist.is_initialized()


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
