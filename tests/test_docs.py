"""The documentation site builds with ``mkdocs build --strict`` (every warning an error: broken links, pages
missing from the nav, unresolvable API references), and its API reference renders the public names."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# page of the API reference -> public names it must document (as a heading of their own, with their docstring)
API_NAMES = {
    "api/core": ["PIDConfig", "MethodConfig", "AttentionMethod", "register_method", "get_method", "list_methods",
                 "finish_warmup", "pid_update", "PIDSelfAttention", "LayerCall", "list_models", "check_version",
                 "InternalChanged", "Internal"],
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


def test_the_plots_and_records_are_in_the_site(site):
    for path in ("demo/vision_robustness.png", "reproduce/reproduce.png", "reproduce/study/study.png",
                 "finetune/finetune.png", "analysis_diagnose.png", "core_demo.png"):
        assert (site / path).is_file(), path
    results = (site / "results" / "index.html").read_text()
    assert "../demo/vision_robustness.png" in results and "mCE vs softmax" in results
