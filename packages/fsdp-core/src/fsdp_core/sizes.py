"""Byte sizes written by people: ``"40GiB"``, ``"1.5 GB"``, ``"512MiB"``, ``1000``.

Memory budgets, checkpoint shard limits and the like take decimal (``kb``, ``MB``, ...)
and binary (``KiB``, ``GiB``, ...) units, case-insensitive.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["SIZE_UNITS", "parse_size"]

#: Unit -> bytes; the empty unit is bytes.
SIZE_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE: Final = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, argument: str = "size") -> int:
    """Positive bytes from an int or a string with an optional unit.

    Args:
        value: bytes, or text such as ``"5GB"`` or ``"512 MiB"``.
        argument: the option's name, for the messages.

    Returns:
        The size in bytes.

    Raises:
        TypeError: ``value`` is neither an int nor a string.
        ValueError: the text is no size, or the size is not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{argument} must be an int or a str, got {type(value).__name__}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        unit = match.group("unit").lower() if match else ""
        if match is None or unit not in SIZE_UNITS:
            raise ValueError(
                f"invalid {argument} {value!r}; write a number and a unit, e.g. 40GiB or "
                f"1.5GB (units: {', '.join(u for u in SIZE_UNITS if u)}, case-insensitive)"
            )
        size = int(float(match.group("number")) * SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{argument} must be positive, got {value!r}")
    return size
