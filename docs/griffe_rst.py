"""A griffe extension: read funcshard's docstrings as the API pages should show them.

funcshard's docstrings are Google style with an ``Example:`` section of doctests (run by
tests/docs/test_doctests.py). Griffe's Google parser knows ``Examples:`` only (``Example:`` would render as an
admonition whose doctest output is read as Markdown), and a few Sphinx roles (``:func:`x```) and a ``::``
literal-block marker appear in the prose. This extension rewrites the docstring text before it is parsed:
``Example:`` -> ``Examples:``, a role -> an inline code span, ``text::`` -> ``text:``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.M)
_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`~?([^`]+)`")
_LITERAL = re.compile(r"(\S)::[ \t]*$", re.M)


def rewrite(text: str) -> str:
    """The docstring ``text`` as griffe's Google parser and Markdown read it."""
    text = _EXAMPLE.sub(r"\1Examples:", text)
    text = _ROLE.sub(r"`\1`", text)
    return _LITERAL.sub(r"\1:", text)


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring of the loaded objects with ``rewrite``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
