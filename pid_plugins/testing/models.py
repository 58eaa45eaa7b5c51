"""The zoo models of the kit: one :class:`Model` per model a method runs on, built through its zoo's public path only
(``timm.create_model(..., attention=, attention_cfg=)``, ``attn_implementation=`` with ``config.<method>``,
``pid_plugins.hf.convert``, mmseg's ``dict(type="PID...", attention=, attention_cfg=)``, fairseq's
``--attention-method`` / ``--attention-cfg``), run, converted, and run by hand (:mod:`.zoos`' references)."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import zoos as zc

Cfg = Optional[dict]


@dataclass(frozen=True)
class Model:
    """One zoo model. ``zoo``: the adapter (``timm``, ``hf``, ``mmseg``, ``fairseq``); ``causal``: a decoder (causal
    mask); ``cached``: it decodes with a cache; ``compile_backend``/``compile_tol``: torch.compile's backend and
    (rtol, atol) (None: not compiled, e.g. mmseg's head, whose layers are the backbone's)."""

    name: str
    zoo: str
    causal: bool = False
    cached: bool = False
    compile_backend: Optional[str] = None
    compile_tol: Tuple[float, float] = (1e-5, 1e-6)

    @property
    def kind(self) -> str:
        return self.name.split("-", 1)[1]

    # ---- building
    def pair(self, method: str, cfg: Cfg, seed: int = 0):
        """(method model, stock model) with the same weights, eval mode."""
        if self.zoo == "timm":
            return zc.timm_pair(self.kind, seed, attention=method, attention_cfg=cfg)
        if self.name == "hf-llama":
            T = zc.import_transformers()
            torch.manual_seed(seed)
            model = T.LlamaForCausalLM(zc.llama_config(method, cfg, kv_heads=2)).eval()
            stock = T.LlamaForCausalLM(zc.llama_config("sdpa", kv_heads=2)).eval()
            stock.load_state_dict(zc.without_record(model.state_dict()))
            return model, stock
        if self.name == "hf-bert":
            return self.convert(self.stock(seed), method, cfg), self.stock(seed)
        stock = self.stock(seed)
        model = self.build(method, cfg, seed + 1)
        zc.load_stock(model, stock.state_dict())
        return model, stock

    def stock(self, seed: int = 0):
        """The stock model alone."""
        if self.name == "hf-bert":
            T = zc.import_transformers()
            torch.manual_seed(seed)
            return T.BertModel(zc.bert_config(layers=3, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0)).eval()
        if self.zoo == "fairseq":
            return zc.fs_build(fairseq_data(), arch="transformer_lm", seed=seed)[0]
        if self.name == "mmseg-segmentor":
            return _segmentor(seed)
        if self.zoo == "mmseg":
            return zc.mm_build(zc.MM_TYPES[self.kind], zc.mm_args(self.kind, 3), seed)
        if self.name == "hf-llama":
            T = zc.import_transformers()
            torch.manual_seed(seed)
            return T.LlamaForCausalLM(zc.llama_config("sdpa", kv_heads=2)).eval()
        return self.pair("softmax", None, seed)[1]

    def build(self, method: str, cfg: Cfg, seed: int = 0):
        """A method model built by the zoo's own path, weights drawn from ``seed``."""
        if self.zoo == "timm":
            timm = zc.import_timm()
            name, _, args = zc.TIMM[self.kind]
            torch.manual_seed(seed)
            return timm.create_model(name, attention=method, attention_cfg=cfg, **args).eval()
        if self.name == "mmseg-segmentor":
            return _segmentor(seed, dict(attention=method, attention_cfg=cfg))
        if self.zoo == "mmseg":
            return zc.mm_build("PID" + zc.MM_TYPES[self.kind], zc.mm_args(self.kind, 3), seed, attention=method,
                               attention_cfg=cfg)
        if self.zoo == "fairseq":
            return zc.fs_build(fairseq_data(), extra=zc.fs_method(method, cfg), seed=seed)[0]
        if self.name == "hf-llama":
            T = zc.import_transformers()
            torch.manual_seed(seed)
            return T.LlamaForCausalLM(zc.llama_config(method, cfg, kv_heads=2)).eval()
        T = zc.import_transformers()
        config = zc.bert_config(layers=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        config._attn_implementation = method
        if cfg is not None:
            setattr(config, method, cfg)
        torch.manual_seed(seed)
        return T.BertModel(config).eval()

    def convert(self, model, method: str, cfg: Cfg = None):
        """The zoo's ``convert`` (in place)."""
        if self.zoo == "timm":
            import pid_plugins.timm as adapter
        elif self.zoo == "hf":
            import pid_plugins.hf as adapter
        elif self.zoo == "mmseg":
            import pid_plugins.mmseg as adapter
        else:
            import pid_plugins.fairseq as adapter
        return adapter.convert(model, method, cfg)

    # ---- running
    def inputs(self, dtype=torch.float32, seed: int = 1):
        if self.zoo == "timm":
            return zc.timm_images(self.kind, seed=seed).to(dtype)
        if self.zoo == "hf":
            return zc.hf_ids(seed=seed)
        if self.name == "mmseg-segmentor":
            return zc.mm_inputs("backbone", dtype, seed=seed) * 50 + 100
        if self.zoo == "mmseg":
            return zc.mm_inputs(self.kind, dtype, seed=seed)
        return zc.fs_tokens(seed=seed)

    def out(self, model, x) -> Tensor:
        if self.name == "hf-llama":
            return model(x).logits
        if self.name == "hf-bert":
            return model(x).last_hidden_state
        if self.name == "mmseg-segmentor":
            return model.encode_decode(x, [dict(img_shape=tuple(x.shape[-2:]))] * len(x))
        if self.zoo == "mmseg":
            return zc.mm_out(self.kind, model, x)
        if self.zoo == "fairseq":
            return model(x)[0]
        return model(x)

    def loss(self, model, x) -> Tensor:
        """A training loss of one forward (the causal LM's own loss where it has one)."""
        if self.name == "hf-llama":
            return model(x, labels=x).loss
        y = self.out(model, x)  # weighted per feature: a normed output's plain mean is constant
        return y.square().mean() + (y * torch.arange(y.shape[-1], dtype=y.dtype)).mean()

    def reference(self, stock, x, rule: zc.Rule) -> Tensor:
        """The stock model's modules run by hand (float64 when ``stock`` is), attention by ``rule``."""
        if self.zoo == "timm":
            return zc.timm_reference(self.kind, stock, x, rule)
        if self.name == "hf-llama":
            return zc.llama_reference(stock, x, rule)
        if self.name == "hf-bert":
            return zc.bert_reference(stock, x, rule)
        if self.zoo == "mmseg":
            return zc.mmseg_reference(self.kind, stock, x, rule)
        return zc.fairseq_reference(stock, x, rule)

    def attention_layers(self, model) -> list:
        """The modules that carry ``attention_method`` / ``attention_config``."""
        if self.zoo == "timm":
            return [blk.attn for blk in model.blocks]
        if self.name == "mmseg-segmentor":
            return [*model.backbone.layers, *model.decode_head.layers]
        if self.zoo == "mmseg":
            return list(model.layers)
        if self.zoo == "fairseq":
            return [layer.self_attn for layer in model.decoder.layers]
        raise ValueError(self.zoo)

    def configs(self, model) -> list:
        """The (attention_method, attention_config) of the model and of every attention layer (transformers: of its
        config)."""
        if self.zoo == "hf":
            import pid_plugins.hf as ph

            return [(ph.method_of(model.config), ph.model_method_config(model.config))]
        layers = self.attention_layers(model)
        assert layers
        top = [(model.attention_method, model.attention_config)] if hasattr(model, "attention_config") else []
        return top + [(layer.attention_method if hasattr(layer, "attention_method") else model.attention_method,
                       layer.attention_config) for layer in layers]


_FAIRSEQ_DATA: List[Any] = []


def fairseq_data() -> Path:
    """A fairseq dictionary folder (:func:`.zoos.fs_dictionary`), made once per process."""
    if not _FAIRSEQ_DATA:
        _FAIRSEQ_DATA.append(zc.fs_dictionary(Path(tempfile.mkdtemp(prefix="pid_plugins_testing_fairseq_"))))
    return _FAIRSEQ_DATA[0]


def _segmentor(seed: int, method: Optional[dict] = None):
    """mmseg's EncoderDecoder (the tiny ViT and Segmenter head), stock or with pid-plugins' types and ``method``."""
    import pid_plugins.mmseg  # noqa: F401  (registers the PID* types)
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS as MM

    pid = "" if method is None else "PID"
    init_default_scope("mmseg")
    torch.manual_seed(seed)
    model = MM.build(dict(
        type="EncoderDecoder", test_cfg=dict(mode="whole"),
        data_preprocessor=dict(type="SegDataPreProcessor", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                               bgr_to_rgb=True, pad_val=0, seg_pad_val=255, size=(32, 32)),
        backbone=dict(type=pid + "VisionTransformer", **zc.mm_args("backbone"), **(method or {})),
        decode_head=dict(type=pid + "SegmenterMaskTransformerHead", **zc.mm_args("head"), **(method or {}))))
    model.init_weights()
    model.eval()
    return model


MODELS: Dict[str, Model] = {m.name: m for m in (
    Model("timm-deit", "timm", compile_backend="aot_eager"),
    Model("timm-fan", "timm", compile_backend="aot_eager"),
    Model("hf-llama", "hf", causal=True, cached=True, compile_backend="aot_eager", compile_tol=(1e-5, 1e-5)),
    Model("hf-bert", "hf", compile_backend="aot_eager", compile_tol=(1e-5, 1e-5)),
    Model("mmseg-backbone", "mmseg", compile_backend="eager", compile_tol=(1e-6, 1e-6)),
    Model("mmseg-head", "mmseg"),
    Model("fairseq-lm", "fairseq", causal=True, cached=True, compile_backend="eager", compile_tol=(1e-5, 1e-5)),
)}
#: the whole mmseg segmentor (backbone and head): what mmseg's ``convert`` switches
SEGMENTOR = Model("mmseg-segmentor", "mmseg")
