"""The documentation site builds with ``mkdocs build --strict`` (every warning an error: broken links, pages
missing from the nav, unresolvable API references), and its API reference renders the public names."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# page of the API reference -> public names it must document (as a heading of their own, with their docstring)
API_NAMES = {
    "api/core": ["PIDConfig", "MethodConfig", "AttentionMethod", "register_method", "get_method", "list_methods",
                 "finish_warmup", "pid_update", "PIDSelfAttention", "LayerCall", "list_models", "check_version",
                 "InternalChanged", "Internal", "FX_LEAVES"],
    "api/methods": ["PIDMethod", "NeuTRENOConfig", "TwicingConfig", "EllipticalConfig", "ValueResidualConfig"],
    "api/timm": ["convert", "MethodBlocks", "PIDVisionTransformer", "FAN", "checkpoint_filter_fn"],
    "api/hf": ["convert", "NoGainDecayTrainerMixin", "gain_parameter_names", "decay_parameter_names", "get_config"],
    "api/mmseg": ["PIDVisionTransformer", "PIDSegmenterMaskTransformerHead", "WeightsOnlyCheckpointHook",
                  "timm_vit_to_mmseg"],
    "api/fairseq": ["load_pid_lm", "PIDTransformerLanguageModel", "PIDTransformerLanguageModelConfig", "USER_DIR"],
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}   # mkdocs-material's banner about MkDocs 2
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.mark.integration
def test_every_page_of_the_nav_is_built(site):
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    nav += re.findall(r"^\s*-\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert len(nav) >= 20
    for page in nav:
        stem = page[:-3]
        built = site / (stem[: -len("README")] if stem.endswith("README") else
                        ("" if stem == "index" else stem + "/")) / "index.html"
        assert built.is_file(), (page, built)
        assert (ROOT / "docs" / page).is_file()


@pytest.mark.integration
@pytest.mark.parametrize("page", sorted(API_NAMES))
def test_api_reference_renders_the_public_names(site, page):
    html = (site / page / "index.html").read_text()
    for name in API_NAMES[page]:
        # mkdocstrings gives each documented object an anchor with its full path
        assert re.search(rf'id="pid_plugins\.[\w.]*\b{name}"', html), f"{name} is not documented on {page}"
    # a docstring was rendered for every object (no object without its text)
    assert html.count('class="doc doc-contents') >= len(API_NAMES[page])
    # Sphinx roles in the docstrings are rendered as code (docs/_ext/griffe_rst_roles.py), not as raw text
    assert not re.search(r":(class|func|meth|mod|data|attr):`", html)


@pytest.mark.integration
def test_the_plots_and_records_are_in_the_site(site):
    for path in ("demo/vision_robustness.png", "reproduce/reproduce.png", "reproduce/study/study.png",
                 "finetune/finetune.png", "analysis_diagnose.png", "core_demo.png"):
        assert (site / path).is_file(), path
    results = (site / "results" / "index.html").read_text()
    assert "../demo/vision_robustness.png" in results and "mCE vs softmax" in results


# ---- docs that read well: no raw reST in the rendered pages, tables and code within the column, formatted signatures

#: the longest table cell and code line (characters) the pages may hold: longer ones overflow the column
WIDTH = 100
PAGES = sorted((ROOT / "docs").rglob("*.md"))

#: raw reStructuredText that reached a rendered page: a literal-block marker ending a paragraph, a directive, a
#: double-backtick literal, a Sphinx role
RAW_REST = {
    "'::' ending a paragraph": re.compile(r"::\s*</p>"),
    "'.. code-block' directive": re.compile(r"\.\. code-block"),
    "``double backticks``": re.compile(r"``"),
    "Sphinx role": re.compile(r":(class|func|meth|mod|data|attr|exc|obj|ref):`"),
}


def _visible_text(html):
    """The page's text as a reader sees it (tags, scripts and the search index left out), entities kept."""
    html = re.sub(r"<(script|style)\b.*?</\1>", "", html, flags=re.S)
    return re.sub(r"<(?!/p>)[^>]+>", "", html)


@pytest.mark.integration
def test_no_raw_rest_on_the_rendered_pages(site):
    found = []
    for page in sorted(site.rglob("*.html")):
        text = _visible_text(page.read_text())
        for what, pattern in RAW_REST.items():
            for match in pattern.finditer(text):
                snippet = text[max(0, match.start() - 60): match.end() + 20].replace("\n", " ")
                found.append(f"{page.relative_to(site)}: {what}: ...{snippet}...")
    assert not found, "raw reST on the site:\n" + "\n".join(found[:30])


def _fenced(text):
    """(line number, language, line) of every line inside a ``` fence."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"\s*(```+)(\w*)", line)
        if opening and (fence is None or opening.group(1) == fence[0]):
            fence = None if fence is not None else (opening.group(1), opening.group(2))
            continue
        if fence is not None:
            yield number, fence[1], line


def _table_cells(text):
    """(line number, cell) of every cell of every markdown table outside the code blocks."""
    in_code = {number for number, _, _ in _fenced(text)}
    for number, line in enumerate(text.splitlines(), 1):
        if number in in_code or not line.lstrip().startswith("|"):
            continue
        # a cell ends at an unescaped | outside inline code
        cells, cell, code = [], "", False
        for char in line.strip().strip("|"):
            if char == "`":
                code = not code
            if char == "|" and not code and not cell.endswith("\\"):
                cells.append(cell.strip())
                cell = ""
            else:
                cell += char
        cells.append(cell.strip())
        for cell in cells:
            yield number, cell


def test_table_cells_are_short():
    """A table cell holds at most a short sentence; the prose goes under the table."""
    long = [f"{page.relative_to(ROOT)}:{number}: {len(cell)} characters: {cell[:80]}..."
            for page in PAGES for number, cell in _table_cells(page.read_text()) if len(cell) > WIDTH]
    assert not long, f"table cells longer than {WIDTH} characters:\n" + "\n".join(long)


def test_code_blocks_fit_the_column():
    long = [f"{page.relative_to(ROOT)}:{number}: ```{language} line of {len(line)} characters: {line[:70]}..."
            for page in PAGES for number, language, line in _fenced(page.read_text()) if len(line) > WIDTH]
    assert not long, f"code-block lines longer than {WIDTH} characters:\n" + "\n".join(long)


@pytest.mark.integration
def test_api_signatures_are_formatted(site):
    """mkdocstrings formats the signatures with ruff (the docs extra); without a formatter each sits on one line."""
    import importlib.util

    assert importlib.util.find_spec("ruff") or importlib.util.find_spec("black"), "the docs extra's ruff is missing"
    html = (site / "api" / "hf" / "index.html").read_text()
    # convert(model, method, config, *, base, ...) is longer than the line length: one parameter per line
    signature = re.search(r'id="pid_plugins\.hf\.convert".*?<div class="doc-signature[^"]*">(.*?)</div>', html, re.S)
    assert signature, "no signature for pid_plugins.hf.convert"
    lines = _visible_text(signature.group(1)).strip().splitlines()
    assert len(lines) > 2 and lines[0].endswith("("), lines
