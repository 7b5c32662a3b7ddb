"""Record and check the public API of each package (``packages/<pkg>/api-snapshot.json``).

The public API is every name in ``__all__`` of the package and of each public
submodule (no leading underscore in its dotted path), described by kind and
signature. Classes add their own public methods, properties and class
attributes. Underscore names are private and not recorded, except the few that
the reference contract names (``CONTRACT_UNDERSCORE_NAMES``: helpers and hooks
that model code written against nemo-automodel calls or overrides).
Names re-exported from another public module are recorded as aliases of the
first place they appear. A public module that imports a framework one of the
package's extras provides (``fsdp_core.integrations.transformers``) cannot be
described where that framework is missing: there a check leaves its recorded
entries alone and a rewrite keeps them; the integration session, which installs
every extra, checks them.

Usage (with the packages and torch installed, e.g. in the repository's .venv)::

    python tools/api_snapshot.py                  # rewrite every snapshot
    python tools/api_snapshot.py multimodal-fsdp  # rewrite one
    python tools/api_snapshot.py --check          # fail if a snapshot is stale

Writing refuses to record a new API under a version that is already released
(a tag ``<package>-v<version>`` with another API exists): bump the version
first (``nox -s bump -- <package> <level>``). See docs/releasing.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import pkgutil
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import monorepo

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: The underscore names of the reference contract: public despite the underscore.
CONTRACT_UNDERSCORE_NAMES = frozenset(
    {
        "_container_items",
        "_is_module_container",
        "_shard_layer_containers_recursively",
        "_fully_shard_module",
    }
)
_SHORT_VALUE_TYPES = (str, int, float)


def _clean(text: str) -> str:
    """Drop memory addresses from reprs so a snapshot is stable from run to run."""
    return _ADDRESS.sub("", text)


def _signature(obj: Callable[..., Any]) -> str:
    try:
        return _clean(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"


def _annotation(hint: Any) -> str:
    if isinstance(hint, typing.ForwardRef):
        return hint.__forward_arg__
    if isinstance(hint, type):
        return hint.__qualname__
    return _clean(str(hint))


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _is_type_alias(obj: Any) -> bool:
    return typing.get_origin(obj) is not None or isinstance(obj, types.UnionType)


def _constant(value: Any) -> str:
    """Small immutable values are part of the contract (``SHARD_DIM = "dp_shard"``);
    for anything else only the type is, since values may depend on the installed torch."""
    if isinstance(value, bool):
        return "constant bool"
    if isinstance(value, _SHORT_VALUE_TYPES) or (
        isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    ):
        text = repr(value)
        if len(text) <= 120:
            return f"constant {type(value).__name__} = {text}"
    return f"constant {type(value).__name__}"


def _describe_class(cls: type) -> str:
    bases = ", ".join(_qualname(base) for base in cls.__bases__)
    kind = "class"
    if dataclasses.is_dataclass(cls):
        params = getattr(cls, "__dataclass_params__", None)
        kind = "dataclass(frozen)" if getattr(params, "frozen", False) else "dataclass"
    elif typing.is_typeddict(cls):
        fields = ", ".join(
            f"{name}: {_annotation(hint)}" for name, hint in cls.__annotations__.items()
        )
        return f"typeddict {{{fields}}}"
    elif issubclass(cls, enum.Enum):
        return f"enum [{', '.join(member.name for member in cls)}]"
    own_init = "__init__" in vars(cls) or dataclasses.is_dataclass(cls)
    signature = _signature(cls) if own_init else "(inherited)"
    return f"{kind}{signature} bases=({bases})"


def _is_public(name: str) -> bool:
    return not name.startswith("_") or name in CONTRACT_UNDERSCORE_NAMES


def _describe_member(cls: type, name: str, value: Any) -> str | None:
    if name.startswith("__") and name.endswith("__"):
        return None
    if not _is_public(name):
        return None
    if isinstance(value, staticmethod):
        return f"staticmethod{_signature(value.__func__)}"
    if isinstance(value, classmethod):
        return f"classmethod{_signature(value.__func__)}"
    if isinstance(value, property):
        getter = value.fget
        returns = inspect.signature(getter).return_annotation if getter else None
        text = "" if returns in (None, inspect.Signature.empty) else f" -> {returns}"
        return f"property{text}" + ("" if value.fset is None else " (settable)")
    if isinstance(value, types.FunctionType):
        return f"method{_signature(value)}"
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return None  # a field default; the field is in the signature
    if isinstance(value, type):
        return f"class {_qualname(value)}"
    return f"attribute {type(value).__name__}"


def describe(obj: Any) -> Iterator[tuple[str, str]]:
    """``("", description)`` for ``obj`` and ``(".member", description)`` for class members."""
    if isinstance(obj, types.ModuleType):
        yield "", f"module {obj.__name__}"
    elif inspect.isclass(obj):
        yield "", _describe_class(obj)
        if not typing.is_typeddict(obj) and not issubclass(obj, enum.Enum):
            for name, value in vars(obj).items():
                text = _describe_member(obj, name, value)
                if text is not None:
                    yield f".{name}", text
    elif _is_type_alias(obj):
        yield "", f"type alias {_clean(repr(obj))}"
    elif inspect.isroutine(obj):
        kind = "async function" if inspect.iscoroutinefunction(obj) else "function"
        yield "", f"{kind}{_signature(obj)}"
    elif isinstance(obj, (tuple, list, dict, set, frozenset, str, int, float, bool, type(None))):
        yield "", _constant(obj)
    else:
        yield "", f"instance of {_qualname(type(obj))}"


def public_modules(import_name: str) -> list[str]:
    """The package and its public submodules, in import order."""
    package = importlib.import_module(import_name)
    names = [import_name]
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{import_name}."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        names.append(info.name)
    return names


def _public_names(module: types.ModuleType) -> list[str]:
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return [name for name in exported if name != "__version__" and _is_public(name)]
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]


def _missing_dependency(error: BaseException, import_name: str) -> str | None:
    """The third-party module whose absence ``error`` (or an error it was raised from)
    reports; None for any other failure."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            top = seen.name.split(".")[0]
            if top != import_name.split(".")[0]:
                return top
        seen = seen.__cause__
    return None


def optional_modules_missing(import_name: str) -> dict[str, str]:
    """Public modules that cannot be imported here because a framework one of the
    package's extras provides is not installed (``fsdp_core.integrations.transformers``
    without transformers): ``{module: missing dependency}``."""
    missing: dict[str, str] = {}
    for module_name in public_modules(import_name):
        try:
            importlib.import_module(module_name)
        except ImportError as error:
            dependency = _missing_dependency(error, import_name)
            if dependency is None:
                raise
            missing[module_name] = dependency
    return missing


def _in_modules(name: str, modules: dict[str, str]) -> bool:
    return any(name.startswith(f"{module}.") for module in modules)


def live_api(import_name: str) -> dict[str, str]:
    """``{qualified name: description}`` of the installed package's public API (without
    the modules ``optional_modules_missing`` names)."""
    api: dict[str, str] = {}
    first_seen: dict[int, str] = {}
    skipped = optional_modules_missing(import_name)
    for module_name in public_modules(import_name):
        if module_name in skipped:
            continue
        module = importlib.import_module(module_name)
        for name in _public_names(module):
            if not hasattr(module, name):
                api[f"{module_name}.{name}"] = "missing (listed in __all__ but not defined)"
                continue
            obj = getattr(module, name)
            key = f"{module_name}.{name}"
            shared = inspect.isclass(obj) or inspect.isroutine(obj) or _is_type_alias(obj)
            if shared and id(obj) in first_seen:
                api[key] = f"alias of {first_seen[id(obj)]}"
                continue
            if shared:
                first_seen[id(obj)] = key
            for suffix, text in describe(obj):
                api[key + suffix] = text
    return dict(sorted(api.items()))


def _comparable(recorded: dict[str, str], import_name: str) -> dict[str, str]:
    """``recorded`` without the entries of modules this environment cannot import (an
    extra's framework is missing): they cannot be checked here, only where every extra
    is installed (the integration session)."""
    skipped = optional_modules_missing(import_name)
    return {name: text for name, text in recorded.items() if not _in_modules(name, skipped)}


def snapshot_for(package: monorepo.Package) -> dict[str, Any]:
    api = live_api(package.import_name)
    skipped = optional_modules_missing(package.import_name)
    if skipped and package.snapshot.is_file():  # keep what cannot be described here
        recorded = monorepo.read_snapshot(package.snapshot)["api"]
        api.update({n: t for n, t in recorded.items() if _in_modules(n, skipped)})
    return {
        "distribution": package.name,
        "version": package.version,
        "api": dict(sorted(api.items())),
    }


def released_api(package: monorepo.Package) -> tuple[str, dict[str, str]] | None:
    """``(version, api)`` recorded at the package's latest release tag, if there is one."""
    previous = monorepo.previous_release(package)
    if previous is None:
        return None
    version, tag = previous
    text = monorepo.file_at(tag, package.snapshot)
    if text is None:
        return None
    import json

    api: dict[str, str] = json.loads(text)["api"]
    return version, api


def stale_problems(package: monorepo.Package) -> list[str]:
    """Why the committed snapshot does not describe the package as it is now."""
    if not package.snapshot.is_file():
        return [f"{package.snapshot} is missing: run `python tools/api_snapshot.py {package.name}`"]
    recorded = monorepo.read_snapshot(package.snapshot)
    live = live_api(package.import_name)
    comparable = _comparable(recorded["api"], package.import_name)
    problems = []
    diff = monorepo.diff_api(comparable, live)
    if diff:
        problems.append(
            f"the public API of {package.name} differs from {package.snapshot.name}:\n"
            f"{diff.describe(comparable, live)}\n"
            f"Regenerate it with `python tools/api_snapshot.py {package.name}` and describe "
            "the change in CHANGELOG.md (docs/releasing.md)."
        )
    if recorded.get("version") != package.version:
        problems.append(
            f"{package.snapshot.name} was taken for {package.name} {recorded.get('version')} "
            f"but the package is {package.version}: regenerate it"
        )
    return problems


def release_problems(package: monorepo.Package) -> list[str]:
    """Why the current API cannot ship under the current version (see ``monorepo``)."""
    released = released_api(package)
    if released is None:
        return []
    version, api = released
    diff = monorepo.diff_api(_comparable(api, package.import_name), live_api(package.import_name))
    return monorepo.api_version_problems(
        package.name,
        version,
        package.version,
        diff,
        package.changelog.read_text(encoding="utf-8"),
    )


def write(package: monorepo.Package) -> bool:
    """Rewrite the snapshot; returns whether it changed. Refuses what `release_problems` refuses."""
    problems = release_problems(package)
    if problems:
        raise SystemExit("\n".join(problems))
    text = monorepo.render_snapshot(snapshot_for(package))
    old = package.snapshot.read_text(encoding="utf-8") if package.snapshot.is_file() else None
    if old == text:
        return False
    package.snapshot.write_text(text, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", help="distribution names (default: all)")
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args(argv)
    table = monorepo.packages()
    chosen = [monorepo.get_package(n) for n in args.packages] or list(table.values())
    failed = False
    for package in chosen:
        if args.check:
            problems = stale_problems(package) + release_problems(package)
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            failed = failed or bool(problems)
            if not problems:
                print(f"{package.name} {package.version}: snapshot up to date")
        else:
            changed = write(package)
            state = "written" if changed else "unchanged"
            print(f"{package.name} {package.version}: {package.snapshot} {state}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
