"""``AttentionMethod.check``: every adapter tells the method, before each layer computes, what it knows about the
attention call (causal, cached, attention dropout, grouped-query), so a method that cannot be exact somewhere
refuses there with its own message. A probe method records what each zoo reports."""
from dataclasses import dataclass

import pytest
import torch

import pid_plugins
from pid_plugins import AttentionMethod, MethodConfig
from pid_plugins.core import AttentionContext

SEEN = []


@dataclass(frozen=True)
class ProbeConfig(MethodConfig):
    refuse: str = ""  # an AttentionContext field: refuse calls where it is True
    PRESETS = {"default": {}}


class Probe(AttentionMethod):
    name = "context_probe"
    config_type = ProbeConfig
    state_fields = ()
    default_presets = {"*": "default"}

    def check(self, config, context):
        SEEN.append(context)
        if config.refuse and getattr(context, config.refuse):
            raise ValueError(f"context_probe cannot run {config.refuse} attention: use another method")

    def update(self, params, out, value_q, state, scale, head_dim):
        return out, ()


pid_plugins.register_method(Probe(), replace=True)


@pytest.fixture(autouse=True)
def fresh():
    SEEN.clear()


def test_timm_reports_dropout_only_in_training():
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401

    model = timm.create_model("pid_deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5,
                              attn_drop_rate=0.1, attention="context_probe")
    x = torch.randn(1, 3, 32, 32)
    model.eval()(x)
    assert SEEN == [AttentionContext()] * 2
    SEEN.clear()
    model.train()(x)
    assert SEEN == [AttentionContext(dropout=True)] * 2
    refusing = timm.create_model("pid_deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5,
                                 attn_drop_rate=0.1, attention="context_probe", attention_cfg={"refuse": "dropout"})
    refusing.eval()(x)
    with pytest.raises(ValueError, match="cannot run dropout attention"):
        refusing.train()(x)


def test_transformers_reports_causal_grouped_and_cached():
    T = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401

    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, attn_implementation="context_probe")
    model = T.LlamaForCausalLM(cfg).eval()
    x = torch.randint(1, 64, (1, 5))
    with torch.no_grad():
        model(x, use_cache=False)
        assert SEEN == [AttentionContext(causal=True, grouped=True)] * 2
        SEEN.clear()
        model.generate(x, max_new_tokens=2, do_sample=False)
    assert SEEN and all(c.cached and c.causal for c in SEEN)
    bert = T.BertModel(T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=64, attn_implementation="context_probe",
                                    context_probe={"refuse": "causal"})).eval()
    SEEN.clear()
    with torch.no_grad():
        bert(x)
    assert SEEN == [AttentionContext()]
    model.config.context_probe = {"refuse": "causal"}
    with torch.no_grad(), pytest.raises(ValueError, match="cannot run causal attention"):
        model(x, use_cache=False)


def test_mmseg_reports_dropout_in_training():
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg  # noqa: F401
    from mmseg.registry import MODELS

    backbone = MODELS.build(dict(type="PIDVisionTransformer", img_size=(32, 32), patch_size=16, embed_dims=32,
                                 num_layers=2, num_heads=2, attn_drop_rate=0.1, attention="context_probe"))
    x = torch.randn(1, 3, 32, 32)
    backbone.eval()  # (mmseg's ViT.train returns None)
    backbone(x)
    assert SEEN == [AttentionContext()] * 2
    SEEN.clear()
    backbone.train()
    backbone(x)
    assert SEEN == [AttentionContext(dropout=True)] * 2


def test_fairseq_reports_causal_and_cached_decoding(tmp_path):
    pytest.importorskip("fairseq")
    from zoo_cases import fs_build, fs_dictionary, fs_method

    def build(cfg):
        return fs_build(fs_dictionary(tmp_path), extra=fs_method("context_probe", cfg), layers=2)[0]

    model = build({})
    tokens = torch.randint(4, 24, (1, 4))
    with torch.no_grad():
        model(tokens)
        assert SEEN == [AttentionContext(causal=True)] * 2
        SEEN.clear()
        model.decoder(tokens[:, :1], incremental_state={})
    assert SEEN == [AttentionContext(causal=True, cached=True)] * 2
    with torch.no_grad(), pytest.raises(ValueError, match="cannot run cached attention"):
        build({"refuse": "cached"}).decoder(tokens[:, :1], incremental_state={})


def test_timm_fx_feature_extraction_runs_the_check_with_concrete_arguments():
    """Under torch.fx (timm's feature extraction) ``is_causal`` is a traced argument: the check is a leaf, run when
    the graph runs, with the concrete values (a method reading ``context.causal`` traces and refuses as in eager)."""
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401
    from timm.models import create_feature_extractor

    model = timm.create_model("pid_deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5,
                              attention="context_probe", attention_cfg={"refuse": "causal"}).eval()
    extractor = create_feature_extractor(model, return_nodes=["blocks.1"])
    x = torch.randn(1, 3, 32, 32)
    SEEN.clear()
    with torch.no_grad():
        got = extractor(x)["blocks.1"]
        want = model.forward_intermediates(x, indices=[1], intermediates_only=True, output_fmt="NLC")[0]
    assert SEEN and all(c == AttentionContext() for c in SEEN)
    torch.testing.assert_close(got[:, model.num_prefix_tokens:], want, rtol=0, atol=0)
