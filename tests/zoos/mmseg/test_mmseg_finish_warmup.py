"""``pid_plugins.finish_warmup(model)`` on mmseg's segmentor: its warm-up form (the stock attention plus the method's
term) kept at a fixed scale of 1 that is not saved, and the finished segmentor converted back to mmseg's own. The zoo
contract (tests/core/test_zoo_contract.py) finishes every method that warms up, built and converted."""
import pytest
import torch

pytest.importorskip("mmseg")
import pid_plugins  # noqa: E402
import pid_plugins.mmseg as pm  # noqa: E402
from mmseg.models.backbones.vit import TransformerEncoderLayer  # noqa: E402
from pid_plugins.testing import SEGMENTOR as S  # noqa: E402
from zoo_cases import weights as zc_weights  # noqa: E402


def logits(model):
    with torch.no_grad():
        return S.out(model, S.inputs())


def test_a_finished_segmentor_converts_back_to_the_stock_one_bit_for_bit():
    model = S.convert(S.stock().train(), "pid", {"learnable": True, "warmup_steps": 3})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        S.loss(model, S.inputs(seed=2 + step)).backward()
        opt.step()
    parts = (model.backbone, model.decode_head)
    pid_plugins.finish_warmup(model.eval())
    for part in parts:  # a fixed scale: 1, a constant (not saved), whatever the mode
        assert part.method_scale().item() == 1.0 and "_warmup_finished" not in part.state_dict()
    weights = {k: v for k, v in zc_weights(model.state_dict()).items() if ".attention_params." not in k}
    pm.convert(model, "softmax")
    parts = (model.backbone, model.decode_head)
    assert not any(hasattr(p, "_warmup_finished") or "_warmup_finished" in p._buffers for p in parts)
    assert all(type(layer) is TransformerEncoderLayer for p in parts for layer in p.layers)
    stock = S.stock(seed=1)
    stock.load_state_dict(weights, strict=True)
    assert list(model.state_dict()) == list(stock.state_dict())
    assert torch.equal(logits(model), logits(stock))


def test_a_model_without_warmup_takes_the_method_path():
    model = pid_plugins.finish_warmup(S.build("pid", None))
    assert all(part.method_scale() is None for part in (model.backbone, model.decode_head))  # no warm-up form
