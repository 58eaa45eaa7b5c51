"""The cases of the kit: what one method must do on one zoo model. Each is ``case(model, method, cfg, rule, zero)``
(a :class:`.models.Model`, the method's registered name, its parameters, its float64 rule for one layer, its
parameters that compute the stock attention) and raises ``AssertionError`` where the method is wrong, the zoo's own
error where it refuses, and returns nothing where it is exact."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from . import zoos as zc
from .models import Cfg, Model


def _method(name: str):
    from pid_plugins.core import get_method

    return get_method(name)


def reference(model: Model, method: str, cfg: Cfg, rule: zc.Rule, zero: Cfg = None) -> None:
    """The whole model in float64 against the stock modules run by hand with ``rule``; the method changes the
    output."""
    net, stock = (m.double() for m in model.pair(method, cfg))
    x = model.inputs(torch.float64)
    with torch.no_grad():
        want = model.reference(stock, x, rule)
        torch.testing.assert_close(model.out(net, x), want, rtol=1e-10, atol=1e-10)
        assert not torch.allclose(model.out(stock, x), want), "the method does not change the output"
        if model.name == "hf-llama":  # ... by more than the float32 comparisons' tolerances there
            assert (model.out(stock, x) - want).abs().max() > 5e-5
        if model.zoo == "timm":  # the normed features too
            features = zc.timm_reference(model.kind, stock, x, rule, features=True)
            torch.testing.assert_close(net.forward_features(x), features, rtol=1e-10, atol=1e-10)
            assert (stock.forward_features(x) - features).abs().max() > 1e-4


def zero(model: Model, method: str, cfg: Cfg, rule: zc.Rule, zero: Cfg = None) -> None:
    """With ``zero`` the method model is the stock model bit for bit, on the stock code path where the method says
    ``is_identity`` (timm: fused and not, intermediates;
    transformers: cached generation and left padding; fairseq: padding, and training with dropout)."""
    net, stock = model.pair(method, zero)
    x = model.inputs()
    identity = _method(method).is_identity(_method(method).configure(zero, model.zoo))
    with torch.no_grad():
        assert torch.equal(model.out(net, x), model.out(stock, x))
    if model.zoo == "timm" and identity:
        assert net.blocks[0].attn.state_size == 0  # the stock code path: nothing threaded
    if model.zoo == "mmseg" and identity:  # mmseg's own layers
        assert all(type(layer).__name__ == "TransformerEncoderLayer" for layer in net.layers)
    if model.zoo == "timm":
        for fused in (True, False):
            zc.set_fused((net, stock), fused)
            with torch.no_grad():
                assert torch.equal(net(x), stock(x))
                got = net.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
                want = stock.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
                assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    elif model.name == "hf-llama":
        with torch.no_grad():
            assert torch.equal(zc.hf_greedy(net, x), zc.hf_greedy(stock, x))
        x[0, :2] = 0
        mask = (x != 0).long()
        with torch.no_grad():
            assert torch.equal(net(x, attention_mask=mask).logits, stock(x, attention_mask=mask).logits)
    elif model.zoo == "fairseq":
        x[0, -3:] = 1  # padding
        with torch.no_grad():
            assert torch.equal(net(x)[0], stock(x)[0])
        for m in (stock, net):  # training mode, with dropout: the same draws, outputs and gradients
            m.train()
            m.decoder.dropout_module.p = 0.1
        torch.manual_seed(5)
        a = stock(x)[0]
        torch.manual_seed(5)
        b = net(x)[0]
        assert torch.equal(a, b)
        a.sum().backward()
        b.sum().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(stock.parameters(), net.parameters()))


def checkpointing(model: Model, method: str, cfg: Cfg, rule: zc.Rule = None, zero: Cfg = None) -> None:
    """The zoo's activation checkpointing equals none: outputs and every gradient (timm: both of its modes;
    transformers: non-reentrant, with and without the cache; mmseg: ``with_cp``, bit for bit). fairseq refuses it
    (``--checkpoint-activations``), and transformers refuses reentrant checkpointing."""
    if model.zoo == "fairseq":
        zc.fs_build(_fairseq_data(), extra=[*zc.fs_method(method, cfg), "--checkpoint-activations"])
        return
    if model.zoo == "timm":
        timm = zc.import_timm()
        for reentrant in (False, True):
            ref, ckpt = model.pair(method, cfg)[0], model.pair(method, cfg)[0]
            ckpt.set_grad_checkpointing(True)
            results = zc.timm_checkpointing_results(timm, (ref, ckpt), lambda: model.inputs(), reentrant)
            assert len(results[1]) == 2 + len(list(ref.parameters())) and all(r is not None for r in results[0])
            for a, b in zip(*results):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        return
    if model.zoo == "mmseg":
        _, results = zc.mm_with_cp_runs(model.kind, lambda: model.pair(method, cfg)[0])
        assert sum(g is not None for g in results[0]) > 10
        zc.assert_equal_or_both_none(*results)
        return
    x = model.inputs()
    if model.name == "hf-llama":  # the method's cache slot follows the checkpointed layers, which drop the cache
        forwards, every = [zc.causal_lm_loss(x, use_cache=False), zc.causal_lm_loss(x, use_cache=True)], True
    else:
        def forward(m):
            out = m(x).last_hidden_state
            return out, out.square().mean()
        forwards, every = [forward], False  # BERT's pooler takes no part
    for forward in forwards:
        net = model.pair(method, cfg)[0].train()
        plain, ckpt = zc.hf_checkpointing_grads(net, forward, every_parameter=every)
        assert plain.keys() == ckpt.keys() and len(plain) > 10
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    try:
        forward(net)
    except ValueError as error:
        assert "use_reentrant': False" in str(error), error
    else:
        raise AssertionError("reentrant gradient checkpointing ran")


def compile(model: Model, method: str, cfg: Cfg, rule: zc.Rule = None, zero: Cfg = None,
            backend: Optional[str] = None, tol=None) -> None:
    """``torch.compile(fullgraph=True)`` equals eager (mmseg: the bound forward; fairseq: the decoder)."""
    backend, (rtol, atol) = backend or model.compile_backend or "eager", tol or model.compile_tol
    net = model.pair(method, cfg)[0]
    x = model.inputs()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = model.out(net, x)
            if model.zoo == "mmseg":
                got = zc.mm_compiled(net, x, backend)
            elif model.zoo == "fairseq":
                got = torch.compile(net.decoder, fullgraph=True, backend=backend)(x)[0]
            else:
                got = model.out(torch.compile(net, fullgraph=True, backend=backend), x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def save_load(model: Model, method: str, cfg: Cfg, rule: zc.Rule = None, zero: Cfg = None) -> None:
    """A save/load round trip by the zoo's own path gives the same outputs bit for bit, with the method and its
    parameters (timm: ``pretrained=True`` from a file, and ``load_checkpoint``; transformers: ``save_pretrained`` /
    ``from_pretrained``; mmseg: mmengine's checkpoint functions; fairseq: a checkpoint as fairseq-train writes it)."""
    net = model.pair(method, cfg, seed=3)[0]
    want_config = _method(method).configure(cfg, model.zoo)
    x, loaded = model.inputs(), []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pth"
        if model.zoo == "timm":
            timm = zc.import_timm()
            name, _, args = zc.TIMM[model.kind]
            torch.save(net.state_dict(), path)
            loaded.append(zc.timm_load_pretrained(name, path, attention=method, attention_cfg=cfg, **args))
            other = model.build(method, cfg, seed=4)
            timm.models.load_checkpoint(other, str(path))  # validate.py's path (weights-only)
            loaded.append(other)
        elif model.zoo == "hf":
            T = zc.import_transformers()
            import pid_plugins.hf as ph

            net.save_pretrained(tmp)
            cls = T.AutoModelForCausalLM if model.name == "hf-llama" else T.BertModel
            again = cls.from_pretrained(tmp).eval()
            assert again.config._attn_implementation == method
            assert ph.model_method_config(again.config) == want_config
            loaded.append(again)
        elif model.zoo == "mmseg":
            from mmengine.runner.checkpoint import load_checkpoint, save_checkpoint

            save_checkpoint({"state_dict": net.state_dict(), "meta": {}}, str(path))
            again = model.build(method, cfg, seed=7)
            load_checkpoint(again, str(path), map_location="cpu", strict=True)  # weights-only
            loaded.append(again)
        else:
            net, task, args = zc.fs_build(_fairseq_data(), extra=zc.fs_method(method, cfg), seed=3)
            again = zc.fs_save_and_reload(net, task, args, str(path))
            saved = torch.load(path, map_location="cpu", weights_only=True)
            assert saved["cfg"]["model"]["attention_method"] == method
            loaded.append(again)
        for again in loaded:
            assert all(got == (_method(method), want_config) for got in model.configs(again))
        with torch.no_grad():
            want = model.out(net, x)
            fresh = model.out(model.build(method, cfg, seed=11), x)
            assert (fresh - want).abs().max() > 1e-6, "loading changed nothing"
            for again in loaded:
                assert torch.equal(model.out(again, x), want)


def generate(model: Model, method: str, cfg: Cfg, rule: zc.Rule = None, zero: Cfg = None) -> None:
    """Cached decoding equals recomputation and no position reads a later token. transformers: ``generate`` with
    the dynamic and the static cache, beam search, a chunk after a cached prefix; fairseq: incremental decoding and
    beam reordering."""
    net = model.pair(method, cfg)[0]
    if model.zoo == "fairseq":
        toks = zc.fs_tokens(length=9)
        full = zc.fs_logits(net, toks)
        torch.testing.assert_close(zc.fs_incremental_logits(net, toks), full, rtol=1e-5, atol=1e-5)
        order = torch.tensor([1, 0])  # beam reordering: the cache follows the rows
        torch.testing.assert_close(zc.fs_reordered_logits(net, toks, order, prefix=4),
                                   zc.fs_logits(net, toks[order])[:, 4:], rtol=1e-5, atol=1e-5)
        _causal(lambda t: zc.fs_logits(net, t), toks, (3, 6), 4, 44)
        return
    x = zc.hf_ids(length=6)
    with torch.no_grad():
        seq, full = zc.assert_cached_generation(net, x)
        beams = dict(num_beams=3, num_return_sequences=3)
        assert torch.equal(zc.hf_greedy(net, x, **beams), zc.hf_greedy(net, x, use_cache=False, **beams))
        first = net(seq[:, :5], use_cache=True)
        rest = net(seq[:, 5:9], past_key_values=first.past_key_values).logits
        torch.testing.assert_close(torch.cat([first.logits, rest], 1), full[:, :9], rtol=1e-5, atol=1e-5)
        _causal(lambda t: net(t).logits, seq, (2, 7), 3, 96)


def padding(model: Model, method: str, cfg: Cfg, rule: zc.Rule = None, zero: Cfg = None) -> None:
    """transformers, left padding: a padded prompt in a batch generates what it generates alone, its logits too."""
    net = model.pair(method, cfg)[0]
    short, long = zc.hf_ids(n=1, length=5, seed=3), zc.hf_ids(n=1, length=8, seed=4)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        out, alone = net.generate(batch, attention_mask=mask, **kw), net.generate(short, **kw)
    torch.testing.assert_close(torch.stack(out.logits, 1)[0], torch.stack(alone.logits, 1)[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(out.sequences[0, 3:], alone.sequences[0])


def _causal(logits: Callable, toks, positions, low: int, high: int) -> None:
    """Changing token ``j`` changes no earlier position's logits, and does change a later one's."""
    full = logits(toks)
    for j in positions:
        changed = toks.clone()
        changed[:, j] = (changed[:, j] - low + 7) % (high - low) + low
        other = logits(changed)
        torch.testing.assert_close(other[:, :j], full[:, :j], rtol=0, atol=0)
        assert not torch.allclose(other[:, j:], full[:, j:])


def _fairseq_data():
    from .models import fairseq_data

    return fairseq_data()


#: every case by name, and where it applies (a model's name is given)
CASES: Dict[str, Callable] = {"reference": reference, "zero": zero, "checkpointing": checkpointing,
                              "compile": compile, "save_load": save_load, "generate": generate, "padding": padding}
APPLIES: Dict[str, Callable[[Model], bool]] = {
    "compile": lambda m: m.compile_backend is not None, "generate": lambda m: m.cached,
    "padding": lambda m: m.name == "hf-llama"}
