"""timm's own model tests (``tests/test_models.py`` of the installed timm's sdist) pass for our models.

``make test-integration`` runs them over the tiny names (:data:`timm_suite.TINY`) without timm's slow
``test_prune_intermediate_layers_contract`` (timm's CI leaves it out too); ``make conformance``
(``PID_TIMM_CONFORMANCE=1``) runs every test over every ``pid_*`` / ``fan_*`` name. TorchScript tests are
left out in both (see the README). The file is fetched from PyPI into ``.cache/`` and patched as
:mod:`timm_suite` describes; nothing of it is stored here.
"""
import os
import re

import pytest

pytest.importorskip("timm")
pytest.importorskip("torchvision")
import timm_suite  # noqa: E402

# timm's own test file, run by a pytest of its own in a subprocess: make test-integration
pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFORMANCE = os.environ.get("PID_TIMM_CONFORMANCE") == "1"


def test_timm_model_tests_pass_for_our_models():
    models = "pid_*,fan_*" if CONFORMANCE else timm_suite.TINY
    args = [] if CONFORMANCE else ["-k", "not test_prune_intermediate_layers_contract"]
    proc = timm_suite.run(models, *args, "-p", "no:warnings")
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(f"timm test_models.py over {models}: {summary}")
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    # each name ran timm's forward, backward, fx forward/backward, non-std cfgs and features tests
    assert passed >= 7 * len(models.split(",")), summary
