"""fairseq adapter: ``--arch transformer_lm_pid`` (and the registry's variants) for ``fairseq-train``.

Use with fairseq's own CLI through ``--user-dir`` (a directory with a unique name, :data:`USER_DIR`)::

    fairseq-train data-bin/x --task language_modeling --user-dir "$(python -m pid_plugins.fairseq)" \\
        --arch transformer_lm_pid --attention-cfg '{"lambda_p": 0.4, "lambda_i": 0.5, "lambda_d": 0.1, "beta": 0.3}' ...

The method is ``--attention-method NAME`` (``pid``, the default; ``softmax``; or a method registered in the process,
e.g. by the user's own ``--user-dir`` module calling ``pid_plugins.register_method``) and its parameters
``--attention-cfg JSON`` (over its fairseq preset; PID's ``lm``): the one spelling of both.

A loaded ``transformer_lm`` (``checkpoint_utils``, the hub interface) switches attention in place with
:func:`convert`, the one way to change a built model's attention (``attention="softmax"`` puts fairseq's own
decoder classes back).

Learnable method parameters (``{"learnable": true}``: PID's gains, value_residual's lambdas) are in fairseq's
parameter group ``attention_params`` (:data:`METHOD_PARAM_GROUP`, the ``param_group`` attribute fairseq's
``--optimizer composite`` reads): a composite config (``fairseq-hydra-train``) with ``weight_decay: 0`` for that
group keeps them out of weight decay. fairseq's other optimizers put every parameter in one group: with
``--weight-decay`` > 0 they decay those too (PID's raw gains towards 0, i.e. the gains towards log 2).

Import-time changes: nothing outside fairseq is patched unless the user opted in. fairseq 0.12.2 and hydra 1.0.7
declare dataclass fields with mutable defaults, which Python 3.11 refuses (fairseq issue #5012), so on 3.11 fairseq
imports only after the opt-in, :mod:`pid_plugins_fairseq_compat`'s hook (it lets those defaults through, only in
``fairseq``/``hydra``): ``python -m pid_plugins_fairseq_compat install`` (a ``.pth`` file: every interpreter of the
environment, fairseq's own commands included) or ``pid_plugins_fairseq_compat.install()`` in the process before
this import. Without it this import stops with an ImportError saying so. With it (:data:`OPTED_IN`):

* ``numpy.compat.long`` (gone in NumPy 2) is provided when missing: fairseq reads it when it builds "eos"-break
  datasets (``fairseq-interactive``, the hub interface's ``score``/``sample``).

Inside fairseq, always:

* ``fairseq.checkpoint_utils.torch.load`` becomes :func:`~pid_plugins.fairseq.checkpoint.safe_torch_load`: fairseq
  loads checkpoints with ``weights_only=True`` whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says
  (:mod:`pid_plugins.fairseq.checkpoint`).
* fairseq's model registry gains ``transformer_lm_pid`` and the registry's architectures (its public
  ``register_model`` / ``register_model_architecture``).
"""
import dataclasses
import os
import sys

from .internals import DATACLASS_FIELD  # (imports no zoo)

OPTED_IN = bool(getattr(dataclasses._get_field, "_pid_plugins_compat", False))
"""Whether the user opted in to the patches outside fairseq: :mod:`pid_plugins_fairseq_compat`'s hook is active in
this process (``python -m pid_plugins_fairseq_compat install``, or ``pid_plugins_fairseq_compat.install()``)."""

OPT_IN = ("opt in to pid-plugins' hook, which relaxes Python's rule for fairseq's and hydra's dataclasses only: "
          "`python -m pid_plugins_fairseq_compat install` once per environment (every interpreter, fairseq's own "
          "commands included), or `import pid_plugins_fairseq_compat; pid_plugins_fairseq_compat.install()` in the "
          "process before importing fairseq")

if OPTED_IN and sys.version_info >= (3, 11):
    DATACLASS_FIELD.require()  # what the hook wraps

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without fairseq
    raise ImportError(
        "pid_plugins.fairseq needs fairseq: pip install -c constraints.txt 'pid-plugins[fairseq]' "
        f"({exc})"
    ) from exc
except ValueError as exc:  # Python 3.11's rule on dataclass defaults, without the opt-in
    if "mutable default" not in str(exc):
        raise
    raise ImportError(f"pid_plugins.fairseq: fairseq 0.12.2 does not import on Python "
                      f"{sys.version_info.major}.{sys.version_info.minor} as published ({exc}; fairseq issue #5012): "
                      f"{OPT_IN}") from None

from ..versions import check_version  # noqa: E402

check_version("fairseq")


def _numpy_compat_long() -> None:
    """fairseq 0.12.2 reads ``numpy.compat.long`` (gone in NumPy 2) when it builds "eos"-break datasets
    (fairseq-interactive, the hub interface's ``score``/``sample``). Provide that one name when missing."""
    import types

    import numpy

    if not hasattr(numpy, "compat"):
        numpy.compat = types.SimpleNamespace(long=int)


if OPTED_IN:
    _numpy_compat_long()

from .checkpoint import UnsafeCheckpointError, install as _install_safe_loading  # noqa: E402

_install_safe_loading()  # fairseq's checkpoint_utils loads with weights_only=True, whatever the environment says

from .model import (  # noqa: E402
    METHOD_PARAM_GROUP,
    PIDMultiheadAttention,
    PIDTransformerDecoder,
    PIDTransformerDecoderLayer,
    PIDTransformerLanguageModel,
    PIDTransformerLanguageModelConfig,
    attention_from_args,
    load_pid_lm,
)
from .conversion import convert  # noqa: E402

USER_DIR = os.path.join(os.path.dirname(__file__), "user_dir", "pid_fairseq")
"""The folder to give fairseq's ``--user-dir`` (``python -m pid_plugins.fairseq`` prints it)."""

__all__ = [
    "PIDMultiheadAttention", "PIDTransformerDecoderLayer", "PIDTransformerDecoder", "PIDTransformerLanguageModel",
    "PIDTransformerLanguageModelConfig", "attention_from_args", "load_pid_lm", "UnsafeCheckpointError", "USER_DIR",
    "METHOD_PARAM_GROUP", "convert",
]
