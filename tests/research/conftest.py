"""Every test in tests/research carries the ``research`` marker: the experiments beside the package (study, demo, their
CLI), the analysis commands and the benchmark tooling."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.research)
