"""MkDocs hooks of the documentation site (mkdocs.yml `hooks:`).

The README's sections that the site includes (pymdownx.snippets) link by reference, ``[text][name]``:
README.md defines each name relative to the repository (for GitHub), the including page relative to
itself (for the site). A name without its definition is no link at all but the literal text
``[text][name]``, which MkDocs' link validation never sees: this hook warns about it, and
``mkdocs build --strict`` (`make docs`) fails on the warning.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger("mkdocs.plugins.lmiserve")  # under `mkdocs`: --strict counts its warnings

# code (inline and blocks) may show brackets as they are; outside it, "[text][name]" is an unresolved link
_CODE = re.compile(r"<(pre|code)\b.*?</\1>", re.DOTALL)
_UNRESOLVED = re.compile(r"\[[^\[\]<>\n]+\]\[[^\[\]<>\n]*\]")


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    for text in _UNRESOLVED.findall(_CODE.sub("", html)):
        log.warning("Doc file '%s' contains a reference link without its definition: %s", page.file.src_path, text)
    return html
