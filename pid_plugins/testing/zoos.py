"""Each zoo's tiny models, built through the zoo's public path, and run by hand in float64.

A reference runs the stock modules (embeddings, norms, projections, MLPs) and writes the attention out by hand; what
a layer does with its attention is the *rule*, a callable given by the author::

    rule(qs, ks, vs, mask) -> u

``qs``/``ks``/``vs``: the query (B, H, N, D) and key/value (B, H_kv, N, D) heads of the group's layers so far (the
current layer last), ``mask``: the additive float64 mask (causal models) or None; ``u`` (B, H, N, D) is the
layer's output before the output projection. :func:`on_outputs` and :func:`on_scores` make a rule from a statement
over the layers' ``A v`` and values, or over one layer's scores. Nothing here calls a method's code. Each zoo is
imported when a model of it is built: importing this module needs only torch.
"""
from __future__ import annotations

import json
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

Rule = Callable[[Sequence[Tensor], Sequence[Tensor], Sequence[Tensor], Optional[Tensor]], Tensor]


# ================================================================================================ attention by hand
def causal_mask(n: int) -> Tensor:
    """The additive causal mask (N, N), float64: -inf above the diagonal."""
    return torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)


def scores64(q: Tensor, k: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """``q k^T / sqrt(D) (+ mask)`` in float64; key head ``j`` serves query heads ``j*r .. j*r + r - 1``."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return scores if mask is None else scores + mask


def attention64(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Softmax attention ``A v`` in float64 (grouped-query: value heads repeated like the key heads)."""
    v = v.double().repeat_interleave(q.shape[1] // v.shape[1], 1)
    return torch.softmax(scores64(q, k, mask), -1) @ v


def on_outputs(statement: Callable[[List[Tensor], List[Tensor]], Tensor]) -> Rule:
    """A rule from ``statement(attn_outs, values) -> u``: the layers' softmax outputs ``A^l v^l`` (B, H, N, D) and
    values ``v^l`` (B, H_kv, N, D) so far, the current layer last (a layer-coupled rule: PID, NeuTRENO, the toy)."""
    def rule(qs, ks, vs, mask):
        return statement([attention64(q, k, v, mask) for q, k, v in zip(qs, ks, vs)], list(vs))
    return rule


def on_scores(statement: Callable[[int, Tensor, Tensor], Tensor]) -> Rule:
    """A rule from ``statement(index, scores, v) -> u``: the current layer's 0-based index in its group, its masked
    float64 scores (:func:`scores64`) and its values."""
    def rule(qs, ks, vs, mask):
        return statement(len(qs) - 1, scores64(qs[-1], ks[-1], mask), vs[-1])
    return rule



def weights(state_dict) -> Dict[str, Tensor]:
    """A state_dict without the method record (``pid_plugins_method``, which a method model saves beside the stock
    model's keys: :mod:`pid_plugins.core.record`), in its order."""
    from pid_plugins.core.record import is_record_key

    return {k: v for k, v in state_dict.items() if not is_record_key(k)}


def assert_equal_or_both_none(got: Sequence[Optional[Tensor]], want: Sequence[Optional[Tensor]]) -> None:
    """Element by element: both None, or equal bit for bit."""
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)

# ================================================================================================ timm
DEIT = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=10)
FAN = dict(img_size=64, embed_dim=48, depth=3, num_heads=4, num_classes=10)
TIMM = {"deit": ("pid_deit_tiny_patch16_224", "deit_tiny_patch16_224", DEIT),
        "fan": ("pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224", FAN)}


def import_timm():
    import timm

    import pid_plugins.timm  # noqa: F401  (registers the pid_* models and the fan_* names)

    return timm


def timm_pair(kind: str, seed: int = 0, models=TIMM, **kwargs):
    """(method model, stock model) with the same weights, both in eval mode: ``kwargs`` go to the method model's
    ``create_model`` (``attention=...``, ``attention_cfg=...``) and ``models`` maps ``kind`` to (PID name, stock
    name, tiny arguments)."""
    timm = import_timm()
    name, base, args = models[kind]
    torch.manual_seed(seed)
    stock = timm.create_model(base, **args)
    model = timm.create_model(name, **kwargs, **args)
    load_stock(model, stock.state_dict())
    return model.eval(), stock.eval()


def timm_images(kind: str, n: int = 2, seed: int = 1, models=TIMM) -> Tensor:
    size = models[kind][2]["img_size"]
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def assert_timm_feature_paths(kind: str, model, models=TIMM, **method) -> Tensor:
    """A method model built by name (eval mode) through timm's feature paths, each exactly its own forward's tensors:
    ``features_only`` (timm's getter wrapping a model built with ``method``, the same weights),
    ``forward_intermediates`` (``stop_early`` too) and timm's fx feature extraction (``create_feature_extractor``).
    Returns the images used."""
    timm = import_timm()
    from timm.models import create_feature_extractor

    name, _, args = models[kind]
    x = timm_images(kind, models=models)
    feats = timm.create_model(name, features_only=True, out_indices=(1, 2), **method, **args).eval()
    assert not feats.model.load_state_dict(model.state_dict(), strict=False).missing_keys  # timm's getter wraps it
    extractor = create_feature_extractor(model, return_nodes={"blocks.1.add_1": "block", "head": "logits"})
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, indices=[1, 2])
        torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=0)
        got = feats(x)
        assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, inter))
        early = model.forward_intermediates(x, indices=[1], stop_early=True, intermediates_only=True)
        assert torch.equal(early[0], inter[0])
        out = extractor(x)
        torch.testing.assert_close(out["logits"], model(x), rtol=0, atol=0)
        want = model.forward_intermediates(x, indices=[1], output_fmt="NLC", intermediates_only=True)[0]
        prefix = model.num_prefix_tokens if kind == "deit" else 0
        torch.testing.assert_close(out["block"][:, prefix:], want, rtol=0, atol=0)
    return x


def set_fused(models, fused: bool) -> None:
    """timm's ``fused_attn`` switch on every block's attention."""
    for m in models:
        for blk in m.blocks:
            blk.attn.fused_attn = fused


def timm_qkv(attn, t: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v (B, H, N, D) from a timm attention's projections: DeiT/ViT's packed ``qkv``, FAN's ``q`` and ``kv``."""
    B, N, _ = t.shape
    if hasattr(attn, "qkv"):
        q, k, v = attn.qkv(t).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v
    q = attn.q(t).reshape(B, N, attn.num_heads, -1).transpose(1, 2)
    k, v = attn.kv(t).reshape(B, N, 2, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    return q, k, v


def timm_reference(kind: str, stock, x: Tensor, rule: Rule, features: bool = False) -> Tensor:
    """The DeiT (``kind="deit"``) or FAN model's modules run by hand, attention by ``rule`` (one group: the blocks);
    the logits, or with ``features`` the normed features (``forward_features``)."""
    if kind == "deit":
        h = stock.norm_pre(stock._pos_embed(stock.patch_embed(x)))
    else:
        h, Hp, Wp = stock._embed(x)
    qs, ks, vs = [], [], []
    for blk in stock.blocks:
        B, N, C = h.shape
        for seen, t in zip((qs, ks, vs), timm_qkv(blk.attn, blk.norm1(h))):
            seen.append(t)
        y = blk.attn.proj(rule(qs, ks, vs, None).transpose(1, 2).reshape(B, N, C))
        if kind == "deit":
            h = h + y
            h = h + blk.mlp(blk.norm2(h))
        else:
            h = h + blk.gamma1 * y
            h = h + blk.gamma2 * blk.mlp(blk.norm2(h), Hp, Wp)
    h = stock.norm(h) if kind == "deit" else stock.norm(stock.forward_cls(h))
    return h if features else stock.forward_head(h)


def timm_checkpointing_results(timm, models, inputs: Callable[[], Tensor], reentrant: bool) -> List[list]:
    """Per model: [output, input grad, parameter grads...] of two forwards and one backward, with timm's
    checkpointing mode ``reentrant`` set for the run (and restored)."""
    results = []
    previous = timm.layers.use_reentrant_ckpt()
    timm.layers.set_reentrant_ckpt(reentrant)
    try:
        for model in models:
            inp = inputs().requires_grad_()
            out = model(inp)
            (out.square().mean() + model(inp * 0.5).mean()).backward()
            results.append([out.detach(), inp.grad] + [p.grad for p in model.parameters()])
    finally:
        timm.layers.set_reentrant_ckpt(previous)
    return results


def timm_load_pretrained(name: str, path, **kwargs):
    """``create_model(pretrained=True)`` from a saved state dict (timm's file overlay), eval mode."""
    timm = import_timm()
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=10),
                             **kwargs).eval()


# ================================================================================================ transformers
def import_transformers():
    import transformers

    import pid_plugins.hf  # noqa: F401  (every registered method becomes an attn_implementation)

    return transformers


def llama_config(attn_implementation: Optional[str] = None, method_cfg=None, layers: int = 3, kv_heads: int = 2,
                 vocab: int = 96, **kw):
    """A tiny LlamaConfig; ``method_cfg`` is the method's parameters (under the method's name)."""
    T = import_transformers()
    args = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64, pad_token_id=0)
    if attn_implementation is not None:
        args["attn_implementation"] = attn_implementation
    if method_cfg is not None:
        args[attn_implementation] = method_cfg
    return T.LlamaConfig(**{**args, **kw})


def without_record(state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """``state_dict`` without the method record and learnable parameters (what a stock model's strict load would
    refuse)."""
    return {k: v for k, v in state_dict.items()
            if not k.endswith("pid_plugins_method") and ".attention_params." not in k}


def load_stock(model, state_dict: Dict[str, Tensor]) -> None:
    """A stock model's weights into a method model: only the method's learnable parameters are left out."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and all(".attention_params." in k for k in missing), (missing, unexpected)


def llama_twins(method: str, method_cfg=None, **kw):
    """(method Llama, stock SDPA Llama) with the same weights (drawn for the method model), eval mode."""
    T = import_transformers()
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config(method, method_cfg, **kw)).eval()
    stock = T.LlamaForCausalLM(llama_config("sdpa", **kw)).eval()
    stock.load_state_dict(without_record(model.state_dict()))
    return model, stock


def assert_cached_generation(model, x: Tensor, new: int = 6, prefix: int = 8) -> Tuple[Tensor, Tensor]:
    """Greedy decoding of ``new`` tokens after ``x`` by recomputation equals ``generate()`` with the dynamic and the
    static cache, and a cached pass from ``prefix`` tokens gives the full pass's logits position by position. Returns
    (the decoded sequence, the full pass's logits)."""
    seq = x
    for _ in range(new):
        step = model(seq, use_cache=False).logits[:, -1]
        seq = torch.cat([seq, step.argmax(-1, keepdim=True)], 1)
    dynamic = model.generate(x, max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
    static = model.generate(x, max_new_tokens=new, do_sample=False, cache_implementation="static", pad_token_id=0)
    assert dynamic.device == seq.device == static.device
    assert torch.equal(dynamic, seq) and torch.equal(static, seq)
    full = model(seq).logits
    out = model(seq[:, :prefix], use_cache=True)
    cache, steps = out.past_key_values, [out.logits[:, -1]]
    for t in range(prefix, seq.shape[1]):
        out = model(seq[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, prefix - 1:], rtol=1e-5, atol=1e-5)
    return seq, full


def bert_config(vocab: int = 96, layers: int = 2, **kw):
    T = import_transformers()
    return T.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, **kw)


def bart_config(vocab: int = 96, **kw):
    T = import_transformers()
    return T.BartConfig(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        **kw)


def hf_ids(n: int = 2, length: int = 8, seed: int = 1, vocab: int = 96) -> Tensor:
    return torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def llama_reference(model, x: Tensor, rule: Rule) -> Tensor:
    """A (float64) Llama by hand: its modules for embeddings, norms, rotary and MLP, attention by ``rule`` under the
    causal mask; the logits."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m = model.model
    B, N = x.shape
    h = m.embed_tokens(x)
    cos, sin = m.rotary_emb(h, torch.arange(N)[None])
    mask = causal_mask(N)
    qs, ks, vs = [], [], []
    for layer in m.layers:
        a = layer.self_attn
        t = layer.input_layernorm(h)
        q, k, v = (p(t).view(B, N, -1, a.head_dim).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        qs.append(q), ks.append(k), vs.append(v)
        h = h + a.o_proj(rule(qs, ks, vs, mask).transpose(1, 2).reshape(B, N, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(m.norm(h))


def bert_reference(model, x: Tensor, rule: Rule) -> Tensor:
    """A (float64) BERT encoder by hand: its modules for embeddings, projections, output blocks and FFN, attention
    by ``rule``; the last hidden state."""
    h = model.embeddings(x)
    qs, ks, vs = [], [], []
    for layer in model.encoder.layer:
        s = layer.attention.self
        B, N, _ = h.shape
        H, D = s.num_attention_heads, s.attention_head_size
        q, k, v = (p(h).view(B, N, H, D).transpose(1, 2) for p in (s.query, s.key, s.value))
        qs.append(q), ks.append(k), vs.append(v)
        att = layer.attention.output(rule(qs, ks, vs, None).transpose(1, 2).reshape(B, N, H * D), h)
        h = layer.output(layer.intermediate(att), att)
    return h


def hf_grads(model, forward: Callable, every_parameter: bool = True) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Zero the gradients, ``out, loss = forward(model)``, backpropagate: (out detached, {name: gradient}) for every
    parameter (``every_parameter``; one without a gradient raises) or for those that got one."""
    model.zero_grad()
    out, loss = forward(model)
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                          if every_parameter or p.grad is not None}


# ================================================================================================ mmseg
MM_BACKBONE = dict(img_size=(32, 32), patch_size=8, embed_dims=48, num_layers=3, num_heads=3, drop_path_rate=0.0,
                   final_norm=True, with_cls_token=True, norm_cfg=dict(type="LN", eps=1e-6))
MM_HEAD = dict(in_channels=48, channels=48, num_classes=5, num_layers=2, num_heads=3, embed_dims=48,
               dropout_ratio=0.0, drop_path_rate=0.0, norm_cfg=dict(type="LN"))
MM_TYPES = {"backbone": "VisionTransformer", "head": "SegmenterMaskTransformerHead"}


def mm_args(part: str, layers: Optional[int] = None) -> dict:
    """The tiny ViT backbone's (``part="backbone"``, 3 layers) or mask-transformer head's (2 layers) arguments."""
    args = dict(MM_BACKBONE if part == "backbone" else MM_HEAD)
    if layers is not None:
        args["num_layers"] = layers
    return args


def mm_build(type: str, args: dict, seed: int = 0, **kw):
    """``MODELS.build`` with the PID types registered, weights initialised from ``seed``, eval mode."""
    import pid_plugins.mmseg  # noqa: F401  (registers the PID* types)
    from mmseg.registry import MODELS

    torch.manual_seed(seed)
    model = MODELS.build(dict(type=type, **args, **kw))
    model.init_weights()
    model.eval()  # mmseg's ViT.train() returns None: not chained
    return model


def mm_pair(part: str, layers: Optional[int] = None, seed: int = 0, **kw):
    """(PID-type part built with ``kw``, stock part) with the stock part's weights (strict)."""
    args = mm_args(part, layers)
    stock = mm_build(MM_TYPES[part], args, seed)
    model = mm_build("PID" + MM_TYPES[part], args, seed + 1, **kw)
    model.load_state_dict(stock.state_dict(), strict=True)
    return model, stock


def mm_inputs(part: str, dtype=torch.float32, seed: int = 1):
    """Images (2, 3, 32, 32) for the backbone, a list of one feature map (2, 48, 4, 4) for the head."""
    g = torch.Generator().manual_seed(seed)
    if part == "backbone":
        return torch.randn(2, 3, 32, 32, generator=g, dtype=dtype)
    return [torch.randn(2, 48, 4, 4, generator=g, dtype=dtype)]


def mm_out(part: str, model, x) -> Tensor:
    return model(x)[0] if part == "backbone" else model(x)


def mmseg_layers(layers, h: Tensor, rule: Rule) -> Tensor:
    """mmseg ``TransformerEncoderLayer``s (pre-norm, packed ``in_proj``, FFN) as one group, attention by ``rule``."""
    qs, ks, vs = [], [], []
    for layer in layers:
        mha = layer.attn.attn
        B, N, C = h.shape
        heads = mha.num_heads
        qkv = (layer.norm1(h) @ mha.in_proj_weight.T + mha.in_proj_bias).reshape(B, N, 3, heads, C // heads)
        for seen, t in zip((qs, ks, vs), qkv.permute(2, 0, 3, 1, 4)):
            seen.append(t)
        h = h + mha.out_proj(rule(qs, ks, vs, None).transpose(1, 2).reshape(B, N, C))
        h = layer.ffn(layer.norm2(h), identity=h)
    return h


def mmseg_reference(part: str, stock, x, rule: Rule) -> Tensor:
    """The stock ViT backbone (its first output map) or mask-transformer head (the class masks) by hand, its layers
    one group (:func:`mmseg_layers`)."""
    if part == "backbone":
        B = x.shape[0]
        h, hw = stock.patch_embed(x)
        h = stock._pos_embeding(torch.cat([stock.cls_token.expand(B, -1, -1), h], 1), hw, stock.pos_embed)
        h = stock.norm1(mmseg_layers(stock.layers, h, rule))
        return h[:, 1:].reshape(B, *hw, -1).permute(0, 3, 1, 2)
    B, _, H, W = x[0].shape
    n = stock.num_classes
    h = stock.dec_proj(x[0].flatten(2).transpose(1, 2))
    h = torch.cat([h, stock.cls_emb.expand(B, -1, -1)], 1)
    h = stock.decoder_norm(mmseg_layers(stock.layers, h, rule))  # the decoder's own group
    patches = F.normalize(stock.patch_proj(h[:, :-n]), dim=2)
    classes = F.normalize(stock.classes_proj(h[:, -n:]), dim=2)
    return stock.mask_norm(patches @ classes.transpose(1, 2)).transpose(1, 2).reshape(B, n, H, W)


def mm_train_step(part: str, model, inputs=None) -> Tuple[Tensor, Optional[Tensor], List[Optional[Tensor]]]:
    """Train mode, one forward and backward of ``square().mean() + mean()``: (output detached, the input's gradient,
    the parameters' gradients)."""
    model.train()
    x = mm_inputs(part) if inputs is None else inputs
    leaf = x.requires_grad_() if part == "backbone" else x[0].requires_grad_()
    y = mm_out(part, model, x)
    (y.square().mean() + y.mean()).backward()
    return y.detach(), leaf.grad, [p.grad for p in model.parameters()]


def mm_with_cp_runs(part: str, build: Callable, input_grad: bool = True):
    """Two parts from ``build()``, the second with every layer's ``with_cp`` set (mmseg's checkpointing), each run
    by :func:`mm_train_step`: (the first part, per part [output, the input's gradient (``input_grad``), the
    parameters' gradients...])."""
    ref, ckpt = build(), build()
    for layer in ckpt.layers:
        layer.with_cp = True
    results = []
    for model in (ref, ckpt):
        y, x_grad, grads = mm_train_step(part, model)
        results.append([y] + ([x_grad] if input_grad else []) + grads)
    return ref, results


def mm_compiled(model, x, backend: str) -> Tensor:
    """The first output of ``torch.compile(model.forward, fullgraph=True, backend=backend)(x)`` under no_grad
    (mmengine modules cannot be wrapped by ``torch.compile(module)``: the bound forward), dynamo reset before and
    after."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            return torch.compile(model.forward, fullgraph=True, backend=backend)(x)[0]
    finally:
        torch._dynamo.reset()


# ================================================================================================ fairseq
def fs_tiny(layers: int = 3) -> List[str]:
    return ["--decoder-layers", str(layers), "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
            "--decoder-attention-heads", "4", "--tokens-per-sample", "32", "--dropout", "0"]


def fs_dictionary(directory):
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for i in range(40):
        dictionary.add_symbol(f"w{i}")
    dictionary.save(str(directory / "dict.txt"))
    return directory


def fs_parse(data_dir, arch: str = "transformer_lm_pid", extra=(), layers: int = 3):
    """fairseq's training arguments for a tiny language model of ``arch`` (pid_plugins' user dir loaded)."""
    import pid_plugins.fairseq as pf
    from fairseq import options

    return options.parse_args_and_arch(options.get_training_parser(), [
        str(data_dir), "--task", "language_modeling", "--arch", arch, "--user-dir", pf.USER_DIR, *fs_tiny(layers),
        *extra])


def fs_build(data_dir, arch: str = "transformer_lm_pid", extra=(), seed: int = 0, layers: int = 3):
    """(model in eval mode, task, args), the weights drawn from ``seed``."""
    from fairseq import tasks

    args = fs_parse(data_dir, arch, extra, layers)
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(args)
    model.eval()
    return model, task, args


def fs_method(name: str, cfg=None) -> List[str]:
    """``--attention-method name`` (and ``--attention-cfg`` JSON unless ``cfg`` is None)."""
    return ["--attention-method", name] + ([] if cfg is None else ["--attention-cfg", json.dumps(cfg)])


def fs_tokens(n: int = 2, length: int = 10, seed: int = 1) -> Tensor:
    return torch.randint(4, 44, (n, length), generator=torch.Generator().manual_seed(seed))


def fs_logits(model, toks: Tensor, **kw) -> Tensor:
    with torch.no_grad():
        return model(toks, **kw)[0]


def fs_save_checkpoint(model, args, path: str) -> None:
    """A checkpoint as fairseq-train writes it (cfg, model, optimizer history), through checkpoint_utils."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    checkpoint_utils.torch_persistent_save({
        "cfg": OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True),
        "args": None, "model": model.state_dict(),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                               "lr_scheduler_state": {}, "num_updates": 0}],
        "extra_state": {"train_iterator": {"epoch": 1}}, "last_optimizer_state": None,
    }, path)


def fs_save_and_reload(model, task, args, path: str):
    """:func:`fs_save_checkpoint`, then fairseq's ``load_model_ensemble`` (weights only): the loaded model, eval
    mode."""
    from fairseq import checkpoint_utils

    fs_save_checkpoint(model, args, path)
    (loaded,), _ = checkpoint_utils.load_model_ensemble([path], task=task)
    return loaded.eval()


def fs_incremental_logits(model, toks: Tensor) -> Tensor:
    """The last position's logits of ``toks[:, :t]``, t = 1 .. N, decoded one token at a time with fairseq's
    incremental state: (B, N, vocabulary)."""
    state, steps = {}, []
    with torch.no_grad():
        for t in range(1, toks.size(1) + 1):
            steps.append(model(toks[:, :t], incremental_state=state)[0][:, -1])
    return torch.stack(steps, 1)


def fs_reordered_logits(model, toks: Tensor, order: Tensor, prefix: int = 4) -> Tensor:
    """Beam reordering: ``toks[:, :prefix]`` decoded one token at a time, the incremental state reordered by
    ``order`` (fairseq's ``reorder_incremental_state_scripting``), then ``toks[order]`` decoded on from ``prefix``;
    the last position's logits of each later step: (B, N - prefix, vocabulary), equal to
    ``fs_logits(model, toks[order])[:, prefix:]`` when the cache follows the rows."""
    state = {}
    with torch.no_grad():
        for t in range(1, prefix + 1):
            model(toks[:, :t], incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, order)
        swapped = toks[order]
        steps = [model(swapped[:, :t], incremental_state=state)[0][:, -1] for t in range(prefix + 1, toks.size(1) + 1)]
    return torch.stack(steps, 1)


def fairseq_reference(stock, toks: Tensor, rule: Rule) -> Tensor:
    """A (float64) transformer_lm's modules run by hand (pre- or post-norm), attention by ``rule`` under the causal
    mask; the logits."""
    dec = stock.decoder
    B, N = toks.shape
    x = dec.embed_scale * dec.embed_tokens(toks)
    if dec.project_in_dim is not None:
        x = dec.project_in_dim(x)
    x = (x + dec.embed_positions(toks)).transpose(0, 1)  # (N, B, C), fairseq's layout
    mask = causal_mask(N)
    qs, ks, vs = [], [], []
    for layer in dec.layers:
        attn = layer.self_attn
        H, D = attn.num_heads, attn.head_dim
        residual = x
        h = layer.self_attn_layer_norm(x) if layer.normalize_before else x
        q, k, v = (p(h).view(N, B, H, D).permute(1, 2, 0, 3) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        qs.append(q), ks.append(k), vs.append(v)
        x = residual + attn.out_proj(rule(qs, ks, vs, mask).permute(2, 0, 1, 3).reshape(N, B, H * D))
        if not layer.normalize_before:
            x = layer.self_attn_layer_norm(x)
        residual = x
        h = layer.final_layer_norm(x) if layer.normalize_before else x
        x = residual + layer.fc2(layer.activation_fn(layer.fc1(h)))
        if not layer.normalize_before:
            x = layer.final_layer_norm(x)
    if dec.layer_norm is not None:
        x = dec.layer_norm(x)
    x = x.transpose(0, 1)
    if dec.project_out_dim is not None:
        x = dec.project_out_dim(x)
    return dec.output_layer(x)


def hf_checkpointing_grads(model, forward: Callable, every_parameter: bool = True):
    """:func:`hf_grads` without, then with non-reentrant gradient checkpointing (left enabled): asserts the outputs
    equal bit for bit and every gradient within rtol 1e-6, atol 1e-7; returns both gradient dicts."""
    plain_out, plain = hf_grads(model, forward, every_parameter)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt_out, ckpt = hf_grads(model, forward, every_parameter)
    torch.testing.assert_close(ckpt_out, plain_out, rtol=0, atol=0)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-6, atol=1e-7)
    return plain, ckpt


def causal_lm_loss(x: Tensor, **kwargs) -> Callable:
    """For :func:`hf_grads`: a causal LM's forward on ``x`` with ``labels=x`` (and ``kwargs``), (logits, loss)."""
    def forward(model):
        out = model(x, labels=x, **kwargs)
        return out.logits, out.loss
    return forward


def hf_greedy(model, x: Tensor, new: int = 5, **kwargs) -> Tensor:
    """``generate()``'s greedy (or, with ``num_beams``, beam-search) tokens after ``x``, no gradients."""
    with torch.no_grad():
        return model.generate(x, max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
