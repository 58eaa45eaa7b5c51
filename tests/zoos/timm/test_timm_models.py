"""timm's own model tests (``tests/test_models.py`` of the installed timm's sdist) pass for our models."""
import os
import re

import pytest

pytest.importorskip("timm")
pytest.importorskip("torchvision")
import timm_suite  # noqa: E402

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
    assert passed >= 7 * len(models.split(",")), summary
