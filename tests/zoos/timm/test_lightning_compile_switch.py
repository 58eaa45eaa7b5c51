"""Lightning's compile switch, as its docs give it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compile_switch import Dynamo, assert_close_state, assert_variant_trained, variants

L = pytest.importorskip("lightning")
timm = pytest.importorskip("timm")
import pid_plugins.timm  # noqa: E402,F401

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
STEPS = 3


class Classifier(L.LightningModule):
    """A timm method model trained on cross-entropy with SGD: a user's LightningModule."""

    def __init__(self, method, cfg):
        super().__init__()
        self.model = timm.create_model("pid_deit_tiny_patch16_224", attention=method, attention_cfg=cfg or None,
                                       **TINY)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(module, fitted=None):
    """``STEPS`` steps of ``Trainer.fit`` on fixed batches (``fitted``: what is handed to ``fit``, else ``module``)."""
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(2 * STEPS, 3, 32, 32, generator=g),
                                          torch.randint(0, 5, (2 * STEPS,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module if fitted is None else fitted, torch.utils.data.DataLoader(data, batch_size=2))
    assert trainer.global_step == STEPS


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("method,cfg", variants("timm-deit", layers=TINY["depth"]))
def test_trainer_fit_of_the_compiled_module_trains_like_eager(method, cfg):
    torch.manual_seed(0)
    module, twin = Classifier(method, cfg), Classifier(method, cfg)
    twin.load_state_dict(module.state_dict(), strict=True)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with Dynamo() as dynamo:
        _fit(module, torch.compile(module, backend="aot_eager"))
        assert dynamo.graph_breaks == {} and dynamo.graphs == 1  # one graph for every step: no recompilation
    _fit(twin)
    assert_close_state(module.state_dict(), twin.state_dict(), moved_from=before, rtol=1e-5, atol=1e-6)
    assert_variant_trained(module, cfg, before, STEPS)
