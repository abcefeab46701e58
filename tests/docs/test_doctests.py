"""The examples in the docstrings run (doctest), one test per module."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import funcshard

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(funcshard.__path__, "funcshard.") if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name}"
