"""Loading a transformers folder never runs pickled code, whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says
(torch reads that variable at every ``torch.load``, so setting it in-process is what a user's shell does)."""
import pickle
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import pid_plugins.hf  # noqa: E402,F401
from research.weights import load_smollm2  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: the file appears if the pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious_folder(tmp_path: Path) -> tuple[Path, Path]:
    folder, marker = tmp_path / "model", tmp_path / "PWNED"
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="pid")
    config.pid = {"lambda_p": 0.4}
    config.save_pretrained(folder)
    with open(folder / "pytorch_model.bin", "wb") as f:  # a legacy pickle checkpoint, as torch.save wrote them
        pickle.dump({"model.embed_tokens.weight": _Payload(marker)}, f, protocol=2)
    return folder, marker


LOADERS = {
    "from_pretrained": (lambda folder: AutoModelForCausalLM.from_pretrained(folder), pickle.UnpicklingError),
    "load_smollm2_cache": (lambda folder: load_smollm2(folder), OSError),
}


@pytest.mark.parametrize("force_no_weights_only", [False, True])
@pytest.mark.parametrize("loader", LOADERS)
def test_a_malicious_pickle_in_a_transformers_folder_is_not_executed(tmp_path, monkeypatch, loader,
                                                                       force_no_weights_only):
    folder, marker = _malicious_folder(tmp_path)
    if force_no_weights_only:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    else:
        monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    load, error = LOADERS[loader]
    with pytest.raises(error, match="(?i)weights.only|safetensors") as info:
        load(folder)
    assert not marker.exists(), "the pickled payload ran"
    assert "PWNED" not in str(info.value) or "weights" in str(info.value).lower()
