"""Every public function, method and class says what it takes, returns and raises.

The public API is what ``tools/api_snapshot.py`` records (``__all__`` of each public
module, the public members of its classes, the reference contract's underscore names).
Its docstrings follow the Google style: an ``Args:`` section where the callable takes
arguments, ``Returns:`` (``Yields:`` for a generator or context manager) where it
returns a value, and ``Raises:`` where its own body raises. A class documents its
constructor's arguments (dataclasses, exceptions, enums and typed dicts excepted: their
fields are the signature). An override needs no sections of its own when its base method
has them, or when the base is another library's (``nn.Module.forward``): it keeps the
contract it overrides.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import api_snapshot  # noqa: E402
import monorepo  # noqa: E402

PACKAGE_NAMES = sorted(monorepo.packages())
_OURS = {monorepo.get_package(name).import_name for name in PACKAGE_NAMES}
_NO_VALUE = {None, "None", "NoReturn", "typing.NoReturn", "Never", inspect.Signature.empty}


def _section(doc: str, *names: str) -> bool:
    lines = {line.strip() for line in doc.splitlines()}
    return any(f"{name}:" in lines for name in names)


def _documented_arguments(doc: str) -> list[str]:
    """The names the ``Args:`` section documents (``*args`` as ``args``)."""
    names: list[str] = []
    lines = doc.splitlines()
    for index, line in enumerate(lines):
        if line.strip() not in ("Args:", "Arguments:"):
            continue
        indent = len(line) - len(line.lstrip())
        for entry in lines[index + 1 :]:
            if entry.strip() and len(entry) - len(entry.lstrip()) <= indent:
                break
            match = re.match(r"\s*\*{0,2}(\w+)(?: \(.*\))?:", entry)
            if match and len(entry) - len(entry.lstrip()) == indent + 4:
                names.append(match[1])
    return names


def _own_raises(function: Callable[..., Any]) -> bool:
    """Whether the function's own body (not a nested function's) raises an exception
    (a bare ``raise`` re-raises what it caught and does not count)."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return False
    tree = ast.parse(source)
    definition = tree.body[0]
    pending: list[ast.AST] = list(ast.iter_child_nodes(definition))
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            return True
        pending.extend(ast.iter_child_nodes(node))
    return False


def _yields(function: Callable[..., Any]) -> bool:
    wrapped = inspect.unwrap(function)
    return inspect.isgeneratorfunction(wrapped) or inspect.isasyncgenfunction(wrapped)


def routine_problems(function: Callable[..., Any], doc: str | None) -> list[str]:
    """The Google-style sections ``doc`` lacks for ``function``."""
    if not doc:
        return ["no docstring"]
    problems = []
    signature = inspect.signature(function)
    arguments = [name for name in signature.parameters if name not in ("self", "cls")]
    if arguments and not _section(doc, "Args", "Arguments"):
        problems.append(f"no Args: for {', '.join(arguments)}")
    unknown = [name for name in _documented_arguments(doc) if name not in arguments]
    if unknown:
        problems.append(f"Args: names {', '.join(unknown)}, not in the signature")
    returns = signature.return_annotation
    if _yields(function) or str(returns).startswith(("Iterator", "Generator", "typing.Iterator")):
        yields_nothing = str(returns).startswith(("Iterator[None]", "Generator[None"))
        if not yields_nothing and not _section(doc, "Yields", "Returns"):
            problems.append("no Yields:")
    elif returns not in _NO_VALUE and not _section(doc, "Returns"):
        problems.append(f"no Returns: for {returns}")
    if _own_raises(function) and not _section(doc, "Raises"):
        problems.append("no Raises:")
    return problems


def _documented_fields(cls: type) -> bool:
    return (
        dataclasses.is_dataclass(cls)
        or issubclass(cls, (BaseException, enum.Enum))
        or typing.is_typeddict(cls)
        or (issubclass(cls, tuple) and hasattr(cls, "_fields"))
        or bool(getattr(cls, "_is_protocol", False))  # a protocol is never constructed
    )


def class_problems(cls: type) -> list[str]:
    """The sections a class's docstring (or its ``__init__``'s) lacks."""
    if not inspect.getdoc(cls):
        return ["no docstring"]
    init = vars(cls).get("__init__")
    if _documented_fields(cls) or not isinstance(init, types.FunctionType):
        return []
    doc = "\n".join(filter(None, (inspect.getdoc(cls), init.__doc__)))
    problems = routine_problems(init, doc)
    return [problem for problem in problems if not problem.startswith("no Returns")]


def _member_problems(cls: type) -> Iterator[tuple[str, list[str]]]:
    for name, value in vars(cls).items():
        if name.startswith("__") or not api_snapshot._is_public(name):
            continue
        function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if not isinstance(function, types.FunctionType):
            continue  # properties and attributes describe a value, not a call
        problems = routine_problems(function, inspect.getdoc(getattr(cls, name)))
        if problems and _documented_on_a_base(cls, name):
            problems = []  # an override keeps the contract its base documents
        yield f".{name}", problems


def _documented_on_a_base(cls: type, name: str) -> bool:
    """Whether a base class defines ``name`` with the sections, or is another library's
    (``nn.Module.forward``, ``extra_repr``: torch documents that contract)."""
    for base in cls.__mro__[1:]:
        if name not in vars(base):
            continue
        if base.__module__.split(".")[0] not in _OURS:
            return True
        value = vars(base)[name]
        function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if isinstance(function, types.FunctionType) and function.__doc__:
            return not routine_problems(function, inspect.getdoc(function))
    return False


def public_objects(import_name: str) -> Iterator[tuple[str, Any]]:
    """``(qualified name, object)`` for each public name, where it is first exported."""
    seen: set[int] = set()
    skipped = api_snapshot.optional_modules_missing(import_name)
    for module_name in api_snapshot.public_modules(import_name):
        if module_name in skipped:
            continue
        module = importlib.import_module(module_name)
        for name in api_snapshot._public_names(module):
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)) or id(obj) in seen:
                continue
            if getattr(obj, "__module__", "").split(".")[0] not in _OURS:
                continue  # another library's object, published for subclassing
            seen.add(id(obj))
            yield f"{module_name}.{name}", obj


def docstring_problems(import_name: str) -> list[tuple[str, str]]:
    """``(defining module, "qualified name: what is missing")`` for each public callable
    of the package."""
    found: list[tuple[str, str]] = []
    for qualified, obj in public_objects(import_name):
        if inspect.isclass(obj):
            entries = [("", class_problems(obj)), *_member_problems(obj)]
        else:
            entries = [("", routine_problems(obj, inspect.getdoc(obj)))]
        found.extend(
            (obj.__module__, f"{qualified}{suffix}: {'; '.join(p)}") for suffix, p in entries if p
        )
    return found


def test_the_checker_names_each_missing_section() -> None:
    def undocumented(x: int) -> int:
        """Doubles."""
        if x < 0:
            raise ValueError(x)
        return 2 * x

    def documented(x: int) -> int:
        """Doubles.

        Args:
            x: any non-negative number.

        Returns:
            twice ``x``.

        Raises:
            ValueError: ``x`` is negative.
        """
        if x < 0:
            raise ValueError(x)
        return 2 * x

    assert routine_problems(undocumented, undocumented.__doc__) == [
        "no Args: for x",
        "no Returns: for int",
        "no Raises:",
    ]
    assert routine_problems(documented, inspect.getdoc(documented)) == []

    def misnamed(x: int) -> None:
        """Checks.

        Args:
            y: a name the signature does not have.
        """

    assert routine_problems(misnamed, inspect.getdoc(misnamed)) == [
        "Args: names y, not in the signature"
    ]


@pytest.mark.parametrize("package", PACKAGE_NAMES)
def test_public_docstrings_have_google_sections(package: str) -> None:
    import_name = monorepo.get_package(package).import_name
    problems = [text for _, text in docstring_problems(import_name)]
    assert not problems, (
        f"{len(problems)} public callables of {package} lack Google-style sections "
        "(Args:/Returns:/Raises:):\n" + "\n".join(problems)
    )
