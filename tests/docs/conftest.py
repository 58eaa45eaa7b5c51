"""Every test in tests/docs carries the ``docs`` marker: the documentation site, the README's and the pages'
examples, the CLI's help, the built wheel. ``make test-fast`` leaves them out; ``make test`` runs them."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.docs)
