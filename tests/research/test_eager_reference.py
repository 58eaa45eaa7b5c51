"""The eager floor's hand-written references (bench/eager_reference.py) compute what the plugin computes: the
bench's plugin/reference ratio is only worth reading if the two models give the same logits."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def reference():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("eager_reference", BENCH / "eager_reference.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.register()
        yield module
    finally:
        sys.path.remove(str(BENCH))


CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("method", ["pid", "neutreno"])
def test_hand_written_reference_equals_the_plugin(reference, method):
    stock, ref, plugin = (reference.llama(a, CFG) for a in ("sdpa", f"ref_{method}", method))
    prompt = torch.randint(0, CFG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = {n: m(prompt).logits for n, m in (("stock", stock), ("ref", ref), ("plugin", plugin))}
        # the method changes the model: a reference equal to stock would prove nothing
        assert (logits["plugin"] - logits["stock"]).abs().max() > 1e-3
        torch.testing.assert_close(logits["ref"], logits["plugin"], rtol=0, atol=1e-6)
        # cached greedy decoding (one query row per step, the state rebuilt each forward): scores and tokens
        out = {n: m.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True) for n, m in (("ref", ref),
                                                                                           ("plugin", plugin))}
    assert torch.equal(out["ref"].sequences, out["plugin"].sequences)
    torch.testing.assert_close(torch.stack(out["ref"].logits), torch.stack(out["plugin"].logits), rtol=0, atol=1e-6)


def test_hand_written_training_reference_equals_the_plugin(reference):
    """The training floor's reference (bench/eager_reference.py --train): the DeiT with PID written by hand gives the
    plugin's logits and gradients, and differs from stock."""
    pytest.importorskip("timm")
    import torch.nn.functional as F

    models = {k: reference.deit(k) for k in ("stock", "reference", "plugin")}
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = {n: m.train()(x) for n, m in models.items()}
    assert (out["plugin"] - out["stock"]).abs().max() > 1e-3
    torch.testing.assert_close(out["reference"], out["plugin"], rtol=1e-5, atol=1e-6)
    for n in ("reference", "plugin"):
        F.cross_entropy(out[n], torch.tensor([1, 7])).backward()
    qkv = {n: models[n].blocks[0].attn.qkv.weight.grad for n in ("reference", "plugin")}
    torch.testing.assert_close(qkv["reference"], qkv["plugin"], rtol=1e-4, atol=1e-6)
