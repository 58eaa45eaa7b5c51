"""tools/uv_sources.py: the Makefile's uv gets the package sources pip is configured with."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("uv_sources", Path(__file__).resolve().parents[2] / "tools" / "uv_sources.py")
uv_sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_sources)


def test_pip_config_becomes_uv_options_in_order():
    config = "\n".join([
        ":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
        ":env:.find-links='/opt/wheels'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.find-links='/elsewhere'",
    ])
    assert uv_sources.uv_options(config) == [
        "--index-strategy", "unsafe-best-match",
        "--index", "file:///opt/pypi/simple", "--index", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels",  # the environment's value replaces the file's, as in pip
    ]


def test_index_url_replaces_the_default_index_and_no_config_gives_only_the_strategy():
    config = "global.index-url='https://mirror.example/simple'\nuser.index-url='https://other.example/simple'"
    assert uv_sources.uv_options(config)[2:] == ["--default-index", "https://other.example/simple"]
    assert uv_sources.uv_options("") == ["--index-strategy", "unsafe-best-match"]
