"""save_pretrained never loses the export it replaces (one process, no process group).

The new export is written into a temporary sibling of the destination, checked,
then swapped in: a failure partway (here an injected ``ENOSPC`` after the first
file) leaves the old export complete and loadable and leaves no temporary
directory behind; files of the user's (tokenizer, README, sub-directories)
survive every save.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors.torch")

from fsdp_core.hf import _save
from fsdp_core.hf.pretrained import load_pretrained, save_pretrained


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])


def _tiny(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def _contents(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _user_files(directory: Path) -> None:
    (directory / "tokenizer.json").write_text('{"vocab": 1}')
    (directory / "README.md").write_text("my notes")
    (directory / "extra" / "deep").mkdir(parents=True)
    (directory / "extra" / "deep" / "notes.txt").write_text("keep me")


def _siblings(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if p.name != directory.name)


@pytest.fixture
def old_export(tmp_path: Path) -> Path:
    directory = tmp_path / "parent" / "export"
    save_pretrained(_tiny(0), directory, max_shard_size="400B")
    _user_files(directory)
    return directory


def test_failed_write_keeps_the_old_export(
    old_export: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _contents(old_export)
    assert len([n for n in before if n.endswith(".safetensors")]) == 3
    real_write = _save.write_file
    calls: list[Path] = []

    def failing_write(path: Path, tensors: dict[str, torch.Tensor]) -> Any:
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, tensors)

    monkeypatch.setattr(_save, "write_file", failing_write)
    with pytest.raises(OSError, match=r"pace|full") as raised:
        save_pretrained(_tiny(1), old_export, max_shard_size="400B")
    assert raised.value.errno == errno.ENOSPC
    assert len(calls) == 2
    assert all(path.parent != old_export for path in calls)  # never written in place
    assert _contents(old_export) == before
    assert _siblings(old_export) == []  # the temporary directory is gone

    fresh = _tiny(2)
    load_pretrained(fresh, old_export)
    for (name, value), (_, expected) in zip(
        fresh.state_dict().items(), _tiny(0).state_dict().items(), strict=True
    ):
        assert torch.equal(value, expected), name


def test_save_replaces_weights_and_keeps_user_files(old_export: Path) -> None:
    files = save_pretrained(_tiny(1), old_export)  # one file now: stale shards must go
    assert "model.safetensors" in files
    names = set(_contents(old_export))
    assert names == {
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "extra/deep/notes.txt",
    }
    assert (old_export / "extra" / "deep" / "notes.txt").read_text() == "keep me"
    assert _siblings(old_export) == []
    fresh = _tiny(2)
    load_pretrained(fresh, old_export)
    assert torch.equal(fresh.layers[0].weight, _tiny(1).layers[0].weight)


def test_save_into_a_new_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "new"
    save_pretrained(_tiny(1), target)
    assert set(_contents(target)) == {"model.safetensors"}
    assert _siblings(target) == []


def test_unwritable_destination_raises_before_anything(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="file"):
        save_pretrained(_tiny(1), blocker / "export")
    assert blocker.read_text() == "not a directory"


def test_without_an_atomic_exchange_two_renames_swap(
    old_export: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_core import _export_swap

    monkeypatch.setattr(_export_swap, "_exchange", lambda first, second: False)
    save_pretrained(_tiny(1), old_export)
    assert set(_contents(old_export)) == {
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "extra/deep/notes.txt",
    }
    assert _siblings(old_export) == []


def test_a_failed_swap_leaves_the_old_export(
    old_export: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_core import _export_swap

    before = _contents(old_export)

    def refuse(first: Path, second: Path) -> bool:
        raise OSError(errno.EBUSY, "Device or resource busy", str(second))

    monkeypatch.setattr(_export_swap, "_exchange", refuse)
    with pytest.raises(OSError, match="busy"):
        save_pretrained(_tiny(1), old_export)
    assert _contents(old_export) == before
    assert _siblings(old_export) == []


def test_a_symlinked_destination_keeps_its_link(tmp_path: Path) -> None:
    real = tmp_path / "real"
    save_pretrained(_tiny(0), real)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    save_pretrained(_tiny(1), link)
    assert link.is_symlink()
    fresh = _tiny(2)
    load_pretrained(fresh, link)
    assert torch.equal(fresh.layers[0].weight, _tiny(1).layers[0].weight)
