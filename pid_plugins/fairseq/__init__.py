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

Import-time changes to third-party modules (each needed for fairseq 0.12.2 to run here; nothing else is patched):

* ``pid_plugins_fairseq_compat.install()``: fairseq 0.12.2 and hydra 1.0.7 declare dataclass fields with mutable
  defaults, which Python 3.11 refuses; the hook (also loaded at start-up by a ``.pth`` file installed with the
  package) lets those defaults through, only in ``fairseq``/``hydra``. Installing it here suffices when this
  module is imported before fairseq.
* ``numpy.compat.long`` (gone in NumPy 2) is provided when missing: fairseq reads it when it builds "eos"-break
  datasets (``fairseq-interactive``, the hub interface's ``score``/``sample``).
* ``fairseq.checkpoint_utils.torch.load`` becomes :func:`~pid_plugins.fairseq.checkpoint.safe_torch_load`: fairseq
  loads checkpoints with ``weights_only=True`` whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says
  (:mod:`pid_plugins.fairseq.checkpoint`).
* fairseq's model registry gains ``transformer_lm_pid`` and the registry's architectures (its public
  ``register_model`` / ``register_model_architecture``).
"""
import os
import sys

import pid_plugins_fairseq_compat

from .internals import DATACLASS_FIELD, NUMPY_COMPAT  # (imports no zoo)

if sys.version_info >= (3, 11):
    DATACLASS_FIELD.require()  # what the hook wraps
pid_plugins_fairseq_compat.install()

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without fairseq
    raise ImportError(
        "pid_plugins.fairseq needs fairseq: pip install -c constraints.txt 'pid-plugins[fairseq]' "
        f"({exc})"
    ) from exc

from ..versions import check_version  # noqa: E402

check_version("fairseq")


def _numpy_compat_long() -> None:
    """fairseq 0.12.2 reads ``numpy.compat.long`` (gone in NumPy 2) when it builds "eos"-break datasets
    (fairseq-interactive, the hub interface's ``score``/``sample``). Provide that one name when missing."""
    import types

    import numpy

    if not hasattr(numpy, "compat"):
        NUMPY_COMPAT.require()  # the one name fairseq reads
        numpy.compat = types.SimpleNamespace(long=int)


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
