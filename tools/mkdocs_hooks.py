"""MkDocs hooks (mkdocs.yml ``hooks:``): checks on the rendered pages.

A Sphinx role left in a docstring (``:func:`name```) renders literally in the API
reference; the strict build fails on one, naming the page. Docstrings link with
the autorefs form ``[name][fully.qualified.name]`` or write plain ``name``
(tests/test_docstring_roles.py names the source line).
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger("mkdocs.hooks.sphinx_roles")

_RENDERED_ROLE = re.compile(
    r":(?:py:)?(func|class|mod|data|meth|attr|exc|obj|const):(?:<code>|`)([^<`]*)"
)


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """Warn (an error under ``--strict``) for each raw Sphinx role on the page."""
    for match in _RENDERED_ROLE.finditer(html):
        log.warning(
            "%s: raw Sphinx role :%s:`%s` in a docstring; write [name][qualified.name] or ``name``",
            page.file.src_path,
            match[1],
            match[2],
        )
    return html
