"""``LayerCall.layer`` is the layer's position within its group, in every zoo: a probe registered as a user registers a
method (``A v``, not the identity) records the index ``layer_params`` receives, built by name and converted, forward,
checkpointed and cached (timm's blocks; transformers' stacks, each from 0; mmseg's two groups; fairseq's decoder)."""
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

import pid_plugins
from pid_plugins import AttentionMethod, MethodConfig
from zoo_cases import (DEIT, FAN, MM_BACKBONE, MM_HEAD, bart_config, bert_config, data_dir, fs_build,  # noqa: F401
                       fs_method, fs_tokens, hf_ids, import_timm, import_transformers, llama_config, mm_build,
                       mm_inputs)

NAME = "layer_probe"


@dataclass(frozen=True)
class LayerProbeConfig(MethodConfig):
    tag: int = 0
    PRESETS = {"default": {"tag": 0}}


class LayerProbe(AttentionMethod):
    """``A v``; records the ``layer`` of every call."""

    name = NAME
    config_type = LayerProbeConfig
    state_fields = ()
    default_presets = {"*": "default"}
    additive = False

    def __init__(self) -> None:
        self.seen: List[Optional[int]] = []

    def layer_params(self, config, learned, layer=None):
        self.seen.append(layer)
        return config

    def update(self, params, out, value_q, state, scale, head_dim):
        return out, ()


PROBE = pid_plugins.register_method(LayerProbe(), replace=True)


@pytest.fixture
def probe():
    PROBE.seen.clear()
    return PROBE


def test_the_index_reaches_layer_params_and_a_method_that_needs_it_is_refused_without_it(probe):
    from pid_plugins.core import LayerCall

    q = v = torch.randn(1, 2, 3, 4)
    attend = lambda a, b: torch.nn.functional.scaled_dot_product_attention(a, a, b)  # noqa: E731
    assert torch.equal(probe.apply(LayerProbeConfig(), None, LayerCall(attend, q, v, v, layer=4), None)[0],
                       attend(q, v))
    probe.apply(LayerProbeConfig(), None, LayerCall(attend, q, v, v), None)
    assert probe.seen == [4, None]

    class NeedsIndex(LayerProbe):  # a user's method whose rule depends on where the layer sits
        name = "needs_index"

        def layer_params(self, config, learned, layer=None):
            return self.require_layer(layer) % 2

    with pytest.raises(ValueError, match=r"'needs_index' reads the layer's index.*passed none.*LayerCall\(\.\.\., "
                                         r"layer=i\), i the 0-based position"):
        NeedsIndex().apply(LayerProbeConfig(), None, LayerCall(attend, q, v, v), None)
    assert NeedsIndex().apply(LayerProbeConfig(), None, LayerCall(attend, q, v, v, layer=1), None)[1] == ()


@pytest.mark.parametrize("kind", ["deit", "fan"])
def test_timm_blocks_by_name_converted_and_checkpointed(kind, probe):
    timm = import_timm()
    import pid_plugins.timm as pt

    name, base, args = {"deit": ("pid_deit_tiny_patch16_224", "deit_tiny_patch16_224", DEIT),
                        "fan": ("pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224", FAN)}[kind]
    x = torch.randn(2, 3, args["img_size"], args["img_size"])
    model = timm.create_model(name, attention=NAME, **args).eval()
    assert [blk.attn.layer_index for blk in model.blocks] == [0, 1, 2]
    with torch.no_grad():
        model(x)
    assert probe.seen == [0, 1, 2]
    # checkpointed blocks (an empty state threaded): the recomputation passes the same indices
    probe.seen.clear()
    model.train().set_grad_checkpointing(True)
    model(x).sum().backward()
    assert probe.seen[:3] == [0, 1, 2] and sorted(probe.seen[3:]) == [0, 1, 2]
    # a stock model converted in place; back to softmax leaves nothing of ours
    stock = timm.create_model(base, **args).eval()
    pt.convert(stock, NAME)
    probe.seen.clear()
    with torch.no_grad():
        stock.forward_intermediates(x, indices=[1])
    assert probe.seen == [0, 1, 2]
    pt.convert(stock, "softmax")
    if kind == "deit":  # back to timm's own classes (FAN keeps its class, softmax inside)
        assert all("layer_index" not in vars(blk.attn) for blk in stock.blocks)


def test_timm_layer_outside_a_model_has_no_index_and_twicing_from_a_later_layer_refuses_it():
    import_timm()
    from pid_plugins.timm import PIDAttention

    choice = pid_plugins.core.resolve_attention("twicing", {"from_layer": 1}, zoo="timm")
    attn = PIDAttention(48, num_heads=3, choice=choice).eval()
    assert attn.layer_index is None
    with pytest.raises(ValueError, match="'twicing' reads the layer's index.*layer=i"):
        attn(torch.randn(1, 4, 48))
    attn.layer_index = 1
    assert attn(torch.randn(1, 4, 48))[1] == ()


def test_hf_llama_index_is_layer_idx_in_forward_checkpointing_and_generate(probe):
    T = import_transformers()
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config(NAME, layers=3)).eval()
    x = hf_ids()
    with torch.no_grad():
        model(x)
    assert probe.seen == [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2]
    probe.seen.clear()
    model.train().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(x, labels=x).loss.backward()
    assert probe.seen[:3] == [0, 1, 2] and sorted(probe.seen[3:]) == [0, 1, 2]
    model.gradient_checkpointing_disable()
    probe.seen.clear()
    with torch.no_grad():
        model.eval().generate(x, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert probe.seen == [0, 1, 2] * 2  # the prompt, then one decoding step


def test_hf_encoder_and_each_stack_of_an_encoder_decoder_count_from_zero(probe):
    T = import_transformers()
    import pid_plugins.hf as ph

    bert = T.BertModel(bert_config(layers=3)).eval()
    ph.convert(bert, NAME)
    with torch.no_grad():
        bert(hf_ids())
    assert probe.seen == [0, 1, 2]
    probe.seen.clear()
    bart = T.BartModel(bart_config()).eval()
    ph.convert(bart, NAME)
    with torch.no_grad():
        bart(hf_ids())
    assert probe.seen == [0, 1, 0, 1]  # the encoder's two layers, then the decoder's (cross-attention: no call)


@pytest.mark.parametrize("with_cp", [False, True])
def test_mmseg_backbone_and_decode_head_are_two_groups(with_cp, probe):
    backbone = mm_build("PIDVisionTransformer", dict(MM_BACKBONE, with_cp=with_cp), attention=NAME)
    head = mm_build("PIDSegmenterMaskTransformerHead", MM_HEAD, attention=NAME)
    assert [layer.layer_index for layer in backbone.layers] == [0, 1, 2]
    if with_cp:
        backbone.train()
        features = backbone(mm_inputs("backbone"))
        head(list(features)).sum().backward()
        assert probe.seen[:5] == [0, 1, 2, 0, 1] and sorted(probe.seen[5:]) == [0, 1, 2]  # + the backbone's recomputed
    else:
        with torch.no_grad():
            head(list(backbone(mm_inputs("backbone"))))
        assert probe.seen == [0, 1, 2, 0, 1]


def test_mmseg_convert_numbers_each_group_and_softmax_strips_it(probe):
    import pid_plugins.mmseg as pm

    from zoos.mmseg.test_mmseg_convert import stock  # a Segmenter segmentor: its backbone and head are each a group

    segmentor = pm.convert(stock(), NAME)
    with torch.no_grad():
        segmentor.decode_head(list(segmentor.backbone(mm_inputs("backbone"))))
    assert probe.seen == [0, 1, 2, 0, 1]
    pm.convert(segmentor, "softmax")
    assert all("layer_index" not in vars(layer) for layer in segmentor.backbone.layers)


def test_fairseq_decoder_built_converted_and_incremental(data_dir, probe):
    import pid_plugins.fairseq as pf

    model, _, _ = fs_build(data_dir, extra=fs_method(NAME))
    toks = fs_tokens()
    with torch.no_grad():
        model(toks)
    assert probe.seen == [0, 1, 2]
    probe.seen.clear()
    incremental = {}
    with torch.no_grad():
        for t in range(2):
            model(toks[:, : t + 1], incremental_state=incremental)
    assert probe.seen == [0, 1, 2] * 2
    stock, _, _ = fs_build(data_dir, arch="transformer_lm", extra=["--decoder-layerdrop", "0.5"])
    stock.train()  # fairseq's LayerDropModuleList skips layers when iterated in training: all are numbered
    pf.convert(stock, NAME)
    assert [stock.decoder.layers[i].self_attn.layer_index for i in range(3)] == [0, 1, 2]
    probe.seen.clear()
    with torch.no_grad():
        stock.eval()(toks)
    assert probe.seen == [0, 1, 2]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "opt",
                                    "gpt_neox", "gpt2", "bert", "modernbert", "vit", "bart", "t5", "whisper"])
def test_hf_every_family_passes_its_stack_position_equal_to_layer_idx(family, probe):
    """The family matrix of tests/zoos/hf/test_hf_families.py: two self-attention layers per stack, each stack from 0; the
    index is the module's position in its stack, which equals ``layer_idx`` wherever a family has one (ViT, BERT
    and others have none: the position is all there is)."""
    import pid_plugins.hf as ph
    from pid_plugins.hf.attention import EARLIER
    from zoos.hf.test_hf_families import FAMILIES, forward, inputs

    make, cls, kind, base, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = ph.convert(cls(make()).eval(), NAME, base=base)
    forward(model, **inputs(family))
    assert probe.seen == ([0, 1, 0, 1] if kind in ("seq2seq", "speech") else [0, 1])
    numbered = [(len(getattr(m, EARLIER)), m.layer_idx) for m in model.modules()
                if hasattr(m, EARLIER) and isinstance(getattr(m, "layer_idx", None), int)]
    assert all(position == layer_idx for position, layer_idx in numbered), numbered
