"""Loading a trained ``transformer_lm_pid`` for inference: fairseq's hub interface (:func:`load_pid_lm`)."""
import os
from typing import Any

from fairseq.models.transformer_lm import TransformerLanguageModel

__all__ = ["load_pid_lm"]


def load_pid_lm(checkpoint: str, data: str, **kwargs: Any):
    """Load a ``transformer_lm_pid`` (or ``transformer_lm``) checkpoint, weights-only, as fairseq's hub interface in
    eval mode. ``data`` is the binarised data directory; ``kwargs`` override the saved model options."""
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"fairseq checkpoint not found: {checkpoint!r}")
    if not os.path.isfile(os.path.join(data, "dict.txt")):
        raise FileNotFoundError(f"no dict.txt in {data!r}: pass the data-bin directory the model was trained on")
    hub = TransformerLanguageModel.from_pretrained(
        os.path.dirname(os.path.abspath(checkpoint)), checkpoint_file=os.path.basename(checkpoint),
        data_name_or_path=os.path.abspath(data), **kwargs)
    hub.eval()
    return hub
