"""Checks of user-given names and paths, public so that model packages taking the same
options reject bad values with the same messages."""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["check_attribute_names", "check_module_paths"]


def check_attribute_names(names: Iterable[str], argument: str) -> tuple[str, ...]:
    """Attribute names (``"vision_tower"``): a collection of non-empty str without dots.

    Args:
        names: the user's names.
        argument: the option's name, for the message.

    Returns:
        The names, as a tuple.

    Raises:
        TypeError: ``names`` is a bare string or holds a non-string.
        ValueError: a name is empty or dotted.
    """
    return _checked(names, argument, "attribute names without dots", lambda n: "." in n)


def check_module_paths(paths: Iterable[str], argument: str = "exclude") -> tuple[str, ...]:
    """Qualified module paths (``"model.vision_tower"``): a collection of non-empty str
    (the root cannot be named).

    Args:
        paths: the user's paths.
        argument: the option's name, for the message.

    Returns:
        The paths, as a tuple.

    Raises:
        TypeError: ``paths`` is a bare string or holds a non-string.
        ValueError: a path is empty.
    """
    return _checked(
        paths,
        argument,
        "qualified module paths",
        lambda p: p.startswith(".") or p.endswith(".") or ".." in p,
    )


def _checked(
    values: Iterable[str], argument: str, what: str, bad: Callable[[str], bool]
) -> tuple[str, ...]:
    """``values`` as a tuple of non-empty str, none of them ``bad``."""
    # A bare str is iterable too; treating "vision" as ("v", "i", ...) would be a silent bug.
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(
            f"{argument} must be a collection of str, got {type(values).__name__}: {values!r}"
        )
    checked = tuple(values)
    for value in checked:
        if not isinstance(value, str):
            raise TypeError(
                f"{argument} entries must be str, got {type(value).__name__}: {value!r}"
            )
    for value in checked:
        if not value or bad(value):
            raise ValueError(f"{argument} entries must be {what}, got {value!r}")
    return checked
