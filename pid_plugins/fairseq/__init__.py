"""fairseq adapter: ``--arch transformer_lm_pid`` (``--user-dir "$(python -m pid_plugins.fairseq)"``) and
:func:`convert`. On Python 3.11 fairseq imports only after the opt-in (:data:`OPTED_IN`, docs/fairseq.md)."""
import dataclasses
import os
import sys

from .._entry import finding_main
from .internals import DATACLASS_FIELD  # (imports no zoo)

#: whether :mod:`pid_plugins_fairseq_compat`'s hook (the user's opt-in) is active in this process
OPTED_IN = bool(getattr(dataclasses._get_field, "_pid_plugins_compat", False))

OPT_IN = ("opt in to pid-plugins' hook, which relaxes Python's rule for fairseq's and hydra's dataclasses only: "
          "`python -m pid_plugins_fairseq_compat install` once per environment (every interpreter, fairseq's own "
          "commands included), or `import pid_plugins_fairseq_compat; pid_plugins_fairseq_compat.install()` in the "
          "process before importing fairseq")

if OPTED_IN and sys.version_info >= (3, 11):
    DATACLASS_FIELD.require()  # what the hook wraps

USER_DIR = os.path.join(os.path.dirname(__file__), "user_dir", "pid_fairseq")
"""The folder to give fairseq's ``--user-dir`` (``python -m pid_plugins.fairseq`` prints it)."""

if not finding_main(__name__):  # the whole adapter, unless `python -m pid_plugins.fairseq` only asks for USER_DIR
    try:
        import fairseq  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without fairseq
        raise ImportError("pid_plugins.fairseq needs fairseq: pip install -c constraints.txt "
                          f"'pid-plugins[fairseq]' ({exc})") from exc
    except ValueError as exc:  # Python 3.11's rule on dataclass defaults, without the opt-in
        if "mutable default" not in str(exc):
            raise
        raise ImportError(f"pid_plugins.fairseq: fairseq 0.12.2 does not import on Python "
                          f"{sys.version_info.major}.{sys.version_info.minor} as published ({exc}; fairseq issue "
                          f"#5012): {OPT_IN}") from None

    from ..versions import check_version  # noqa: E402

    check_version("fairseq")

    def _numpy_compat_long() -> None:
        """Provide ``numpy.compat.long`` (gone in NumPy 2), which fairseq 0.12.2 reads for "eos"-break datasets."""
        import types

        import numpy

        if not hasattr(numpy, "compat"):
            numpy.compat = types.SimpleNamespace(long=int)

    if OPTED_IN:
        _numpy_compat_long()

    from .checkpoint import UnsafeCheckpointError, install as _install_safe_loading  # noqa: E402

    _install_safe_loading()  # fairseq's checkpoint_utils loads with weights_only=True, whatever the environment says

    from .model import (  # noqa: E402
        METHOD_PARAM_GROUP, PIDMultiheadAttention, PIDTransformerDecoder, PIDTransformerDecoderLayer,
        PIDTransformerLanguageModel, PIDTransformerLanguageModelConfig, attention_from_args, load_pid_lm,
    )
    from .conversion import convert  # noqa: E402

__all__ = [
    "PIDMultiheadAttention", "PIDTransformerDecoderLayer", "PIDTransformerDecoder", "PIDTransformerLanguageModel",
    "PIDTransformerLanguageModelConfig", "attention_from_args", "load_pid_lm", "UnsafeCheckpointError", "USER_DIR",
    "METHOD_PARAM_GROUP", "convert",
]
