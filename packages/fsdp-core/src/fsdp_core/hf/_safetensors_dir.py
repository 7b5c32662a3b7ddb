"""The Hugging Face checkpoint directory layout: safetensors files and their index.

A directory holds either one ``model.safetensors`` or several
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {key: file}}``). ``safetensors`` is an
optional dependency (the ``fsdp-core[hf]`` extra), imported only when used;
it is reached through small protocols so that type checking needs no stubs.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final, Protocol, cast

import torch

SINGLE_FILE: Final = "model.safetensors"
INDEX_FILE: Final = "model.safetensors.index.json"
_SHARD_FILE: Final = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

PathLike = str | os.PathLike[str]


class SafeSlice(Protocol):
    """A lazily read tensor of an open safetensors file."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


class SafeFile(Protocol):
    """An open safetensors file (``safetensors.safe_open(..., framework="pt")``)."""

    def keys(self) -> list[str]: ...

    def get_slice(self, name: str) -> SafeSlice: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...


def require_safetensors() -> ModuleType:
    """The ``safetensors.torch`` module, or an ImportError naming the extra to install."""
    try:
        return importlib.import_module("safetensors.torch")
    except ImportError as exc:
        raise ImportError(
            "reading and writing Hugging Face checkpoints needs the 'safetensors' package: "
            "pip install 'fsdp-core[hf]'"
        ) from exc


def open_file(path: Path) -> AbstractContextManager[SafeFile]:
    """Open one safetensors file for lazy, memory-mapped reads on the CPU."""
    require_safetensors()
    opened: Any = importlib.import_module("safetensors").safe_open(
        str(path), framework="pt", device="cpu"
    )
    return cast("AbstractContextManager[SafeFile]", opened)


@dataclass(frozen=True)
class CheckpointLayout:
    """Which file of ``directory`` holds each checkpoint key."""

    directory: Path
    weight_map: Mapping[str, str]

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.weight_map.values())))

    def keys_by_file(self) -> Iterator[tuple[str, list[str]]]:
        for name in self.files:
            yield name, sorted(k for k, f in self.weight_map.items() if f == name)


def read_layout(directory: PathLike) -> CheckpointLayout:
    """The keys of a checkpoint directory, from its index or its single file."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
    index = root / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(f"{index} has no 'weight_map' of key -> file name")
        absent = sorted({f for f in weight_map.values() if not (root / f).is_file()})
        if absent:
            raise FileNotFoundError(f"{index} names files that are not in {root}: {absent}")
        return CheckpointLayout(root, dict(weight_map))
    single = root / SINGLE_FILE
    if single.is_file():
        with open_file(single) as handle:
            return CheckpointLayout(root, dict.fromkeys(handle.keys(), SINGLE_FILE))
    raise FileNotFoundError(
        f"{str(root)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE} (what save_pretrained writes)"
    )


def plan_files(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Keys grouped into files of at most ``max_bytes`` (a bigger tensor gets its own)."""
    files: list[list[str]] = []
    current: list[str] = []
    used = 0
    for key, size in sizes:
        if current and used + size > max_bytes:
            files.append(current)
            current, used = [], 0
        current.append(key)
        used += size
    if current or not files:
        files.append(current)
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def is_weight_file(name: str) -> bool:
    """Whether ``name`` is a weight file or index of a ``save_pretrained`` export."""
    return name in (SINGLE_FILE, INDEX_FILE) or bool(_SHARD_FILE.match(name))


def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    require_safetensors().save_file(tensors, str(path), metadata={"format": "pt"})


def write_index(directory: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def verify_export(work: Path, weight_map: dict[str, str]) -> None:
    """Read the written export back: the same keys in the same files, no empty file."""
    layout = read_layout(work)
    if dict(layout.weight_map) != weight_map:
        wrong = sorted(set(layout.weight_map.items()) ^ set(weight_map.items()))[:4]
        raise OSError(errno.EIO, f"the written export lists other keys than were saved: {wrong}")
    for name, keys in layout.keys_by_file():
        path = work / name
        if path.stat().st_size == 0:
            raise OSError(errno.EIO, "an exported file is empty", str(path))
        with open_file(path) as handle:
            if sorted(handle.keys()) != keys:
                raise OSError(errno.EIO, "an exported file holds other keys", str(path))
