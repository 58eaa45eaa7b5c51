"""Twicing attention (``attention="twicing"``), ``A v + A (v - A v)``, against references written from the official
rule (github.com/lazizcodes/twicing_attention) with the attention matrix formed in float64 (zoo_cases' ``twice64``).
The zoo grid is tests/core/test_method_contract.py; here: the rule, its grouped-query and cache-slot exactness,
``from_layer``, the refusal of attention dropout in every zoo, and BART's two self-attention stacks.
"""

import pytest
import torch
import torch.nn.functional as F

from pid_plugins.core import AttentionContext, CacheSlot, LayerCall, get_method
from pid_plugins.core.siblings.twicing import Twicing, TwicingConfig, twicing_rule
from zoo_cases import bart_config, fs_build, fs_method, fs_tokens, hf_ids, import_transformers, twice64

NAME = "twicing"


# ============================================================================================== core
def _loop_reference(q, k, v, causal):
    """Position by position: u_i = sum_j A_ij v_j + sum_j A_ij (v_j - sum_m A_jm v_m), A from its definition."""
    B, H, N, D = q.shape
    u = torch.zeros(B, H, N, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            A = torch.zeros(N, N, dtype=torch.float64)
            for i in range(N):
                keys = range(i + 1) if causal else range(N)
                s = torch.tensor([float(q[b, h, i] @ k[b, h, j]) / D ** 0.5 for j in keys], dtype=torch.float64)
                A[i, : len(s)] = torch.softmax(s, 0)
            av = [sum(A[j, m] * v[b, h, m] for m in range(N)) for j in range(N)]
            for i in range(N):
                u[b, h, i] = av[i] + sum(A[i, j] * (v[b, h, j] - av[j]) for j in range(N))
    return u


@pytest.mark.parametrize("causal", [False, True])
def test_rule_matches_its_loop_statement_in_both_output_layouts(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    want = _loop_reference(q, k, v, causal)

    def attend(query, value):  # (B, H, N, D) out
        return F.scaled_dot_product_attention(query, k, value, is_causal=causal)

    torch.testing.assert_close(twicing_rule(attend, q, v), want, rtol=1e-12, atol=1e-12)
    # transformers' layout: values (B, H, N, D) in, (B, N, H, D) out; also with as many heads as positions
    out = twicing_rule(lambda query, value: attend(query, value).transpose(1, 2), q, v, head_dim=-2)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-12, atol=1e-12)
    q3, k3, v3 = (t[:, :, :3] for t in (q, k, v))
    square = twicing_rule(lambda a, b: F.scaled_dot_product_attention(a, k3, b, is_causal=causal).transpose(1, 2),
                          q3, v3, head_dim=-2)
    torch.testing.assert_close(square, _loop_reference(q3, k3, v3, causal).transpose(1, 2), rtol=1e-12, atol=1e-12)
    # the language code's form: (2A - A A) v
    mask = torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1) if causal else 0.0
    a = torch.softmax(q @ k.transpose(-1, -2) / 2 + mask, -1)
    torch.testing.assert_close(want, (2 * a - a @ a) @ v, rtol=1e-12, atol=1e-12)


def test_config_presets_and_validation():
    method = get_method(NAME)
    assert isinstance(method, Twicing) and not method.additive and method.state_fields == ()
    assert TwicingConfig.preset("vision") == TwicingConfig(from_layer=0) == method.configure(None, "hf")
    assert TwicingConfig.preset("lm").from_layer == 14
    assert method.configure({"from_layer": 3}, "timm") == TwicingConfig(3)
    assert TwicingConfig.from_dict(TwicingConfig(2).to_dict()) == TwicingConfig(2)
    assert not TwicingConfig().is_zero and not method.is_identity(TwicingConfig(100))
    for bad, match in ((-1, "from_layer must be a layer index >= 0"), (1.5, "from_layer must be int"),
                       (True, "from_layer must be int")):
        with pytest.raises(ValueError, match=match):
            TwicingConfig(from_layer=bad)
    assert method.make_learned(TwicingConfig()) is None
    for field in ("alpha", "learnable"):  # the official class defines alpha but never uses it
        with pytest.raises(ValueError, match=rf"unknown TwicingConfig field\(s\) \['{field}'\]"):
            method.configure({field: 0.5})


def test_check_refuses_only_attention_dropout():
    """Grouped-query attention and a KV cache are computed exactly (keys expanded for the second call, A v kept in
    the cache); one dropout draw cannot serve two calls."""
    method, config = get_method(NAME), TwicingConfig()
    method.check(config, AttentionContext(causal=True, cached=True, grouped=True))
    with pytest.raises(ValueError, match="'twicing'.*set the attention dropout to 0"):
        method.check(config, AttentionContext(dropout=True))


def test_from_layer_counts_the_layers_of_a_group():
    """Five layers, each the one call with its index in the group (``LayerCall.layer``): stock attention before
    ``from_layer``, twicing from it on; nothing is handed from layer to layer."""
    method, config = get_method(NAME), TwicingConfig(from_layer=2)
    g = torch.Generator().manual_seed(1)
    state = None
    for layer in range(5):
        q, k, v = (torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64) for _ in range(3))
        plain = lambda a, b: F.scaled_dot_product_attention(a, k, b)  # noqa: E731
        out, state = method.apply(config, None, LayerCall(plain, q, v, v, layer=layer), state)
        scores = q @ k.transpose(-1, -2) / 3 ** 0.5
        if layer >= 2:
            torch.testing.assert_close(out, twice64(scores, v), rtol=1e-12, atol=1e-12)
        else:  # the stock attention exactly: one call of the zoo's attention
            torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, rtol=1e-12, atol=1e-12)
            assert torch.equal(out, plain(q, v))
        assert state == ()
    # the index decides, not the calls before: a group's layer 3 twices when called first
    out, _ = method.apply(config, None, LayerCall(plain, q, v, v, layer=3), None)
    torch.testing.assert_close(out, twice64(q @ k.transpose(-1, -2) / 3 ** 0.5, v), rtol=1e-12, atol=1e-12)
    assert method.layer_params(config, None, layer=1) is None and method.layer_params(config, None, 2) is config
    # from_layer=0 (every layer twices) needs no index; from_layer > 0 refuses a call without one, naming the method
    assert method.apply(TwicingConfig(), None, LayerCall(plain, q, v, v), None)[1] == ()
    with pytest.raises(ValueError, match="'twicing' reads the layer's index.*LayerCall\\(\\.\\.\\., layer=i\\)"):
        method.apply(config, None, LayerCall(plain, q, v, v), None)


def test_grouped_query_heads_and_a_cache_slot_are_exact():
    """Two query heads per key/value head: the second call gets the values expanded to the query heads (the keys
    too, inside ``attend``), against the float64 rule per query head. With two past key positions, ``A v`` of the
    past comes from the slot; without one the rule refuses rather than mixing positions."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, 5, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 3, 5, generator=g, dtype=torch.float64) for _ in range(2))

    def attend(a, b, k=k):
        return F.scaled_dot_product_attention(a, k.repeat_interleave(2, 1), b.repeat_interleave(a.shape[1] // b.shape[1], 1))

    want = twice64(q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 5 ** 0.5, v.repeat_interleave(2, 1))
    torch.testing.assert_close(twicing_rule(attend, q, v), want, rtol=1e-12, atol=1e-12)
    # decoding the last position with A v of the first two from a slot: the last row of the full computation
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    full = lambda a, b: F.scaled_dot_product_attention(  # noqa: E731
        a, k.repeat_interleave(2, 1), b.repeat_interleave(a.shape[1] // b.shape[1], 1), attn_mask=causal[-a.shape[2]:])
    past_av = full(q, v)[:, :, :2]
    slot = lambda rows: torch.cat([past_av, rows], dim=2)  # noqa: E731
    torch.testing.assert_close(twicing_rule(full, q[:, :, 2:], v, slot=slot), twicing_rule(full, q, v)[:, :, 2:],
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="CacheSlot"):
        twicing_rule(full, q[:, :, 2:], v)


@pytest.mark.parametrize("static", [False, True])
def test_a_decoding_step_makes_one_call(static):
    """A slot that offers its past rows (``CacheSlot.past``) turns a decoding step into one call of the zoo's
    attention over ``[v | v - S | e_t]``, equal to the two calls; a static buffer's stale rows (at and after the
    query's own position) change nothing."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 4, 5, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 4, 5, generator=g, dtype=torch.float64) for _ in range(2))
    calls = []

    def full(a, b):  # the last query position is the current one (key 3); keys after it never exist here
        calls.append(b.shape[-1])
        mask = torch.ones(4, 4, dtype=torch.bool).tril()[-a.shape[2]:]
        return F.scaled_dot_product_attention(a, k.repeat_interleave(2, 1), b.repeat_interleave(
            a.shape[1] // b.shape[1], 1), attn_mask=mask)

    want = twicing_rule(full, q, v)[:, :, 3:]
    past_av = full(q, v)[:, :, :3]
    stored = []

    class Slot(CacheSlot):
        def __call__(self, rows):
            stored.append(rows)
            return torch.cat([past_av, rows], dim=2)

        def past(self, k_len):
            current = (torch.arange(k_len) == 3)[:, None]
            rows = torch.cat([past_av, torch.randn(2, 4, 1, 5, generator=g, dtype=torch.float64) if static
                              else torch.zeros(2, 4, 1, 5, dtype=torch.float64)], dim=2)
            return rows.masked_fill(current, 0), current

    calls.clear()
    got = twicing_rule(full, q[:, :, 3:], v, slot=Slot())
    assert calls == [11]  # one call, values 2 D + 1 wide
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stored[0], full(q, v)[:, :, 3:], rtol=1e-12, atol=1e-12)  # A v of the step, kept


# ============================================================================================== dropout
def test_attention_dropout_is_refused_in_training(tmp_path):
    """One dropout draw cannot serve the rule's two calls: fairseq's decoder in training is refused before anything
    is computed (timm and mmseg report dropout in training only: test_method_checks.py; transformers:
    test_method_hf_lm.py)."""
    from zoo_cases import fs_dictionary

    dropping, _, _ = fs_build(fs_dictionary(tmp_path), extra=[*fs_method(NAME), "--attention-dropout", "0.1"])
    dropping(fs_tokens())  # eval
    dropping.train()
    with pytest.raises(ValueError, match="set the attention dropout to 0"):
        dropping(fs_tokens())


# ============================================================================================== transformers
V = 64


def test_hf_encoder_decoder_twices_both_self_attention_stacks_and_stays_causal():
    T = import_transformers()
    import pid_plugins.hf as ph

    torch.manual_seed(0)
    bart = T.BartModel(bart_config(V)).eval()
    x = hf_ids(vocab=V)
    with torch.no_grad():
        want = bart(x).last_hidden_state
        ph.convert(bart, NAME, {"from_layer": 2})  # past each stack's last layer: the stock model
        assert torch.equal(bart(x).last_hidden_state, want)
        ph.convert(bart, NAME, "vision")
        full = bart(x).last_hidden_state
        assert not torch.allclose(full, want)
        # the decoder's self-attention stays causal (the encoder sees all of x; change only the decoder's input)
        dec = x.clone()
        dec[:, 5] = (dec[:, 5] + 1 - 3) % (V - 3) + 3
        other = bart(x, decoder_input_ids=dec).last_hidden_state
        ref = bart(x, decoder_input_ids=x).last_hidden_state
        torch.testing.assert_close(other[:, :5], ref[:, :5], rtol=0, atol=0)
        assert not torch.allclose(other[:, 5:], ref[:, 5:])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_hf_decoding_makes_one_call_per_layer_and_step(cache, monkeypatch):
    """transformers' cache layers offer their past rows (under torch.compile; here in eager too): every decoding step
    of every layer takes the one-call path, and the greedy logits equal the model's over the whole sequence without a
    cache. Compiled: test_compiled_static_decoding_makes_one_call."""
    import pid_plugins.core.siblings.twicing as tw
    from pid_plugins.hf.cache import LayerSlot
    from zoo_cases import gqa_llama

    monkeypatch.setattr(LayerSlot, "eager_one_call", True)

    one_call, steps = tw._one_call, []
    monkeypatch.setattr(tw, "_one_call", lambda *a: steps.append(1) or one_call(*a))
    model, x = gqa_llama(NAME), hf_ids(vocab=128)[:, :6]
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, **kw)
        full = model(out.sequences[:, :-1], use_cache=False).logits[:, -5:]
    assert len(steps) == 4 * 4  # 4 layers, 4 decoding steps after the prompt's
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_static_decoding_makes_one_call(monkeypatch):
    """transformers' compiled decoding step on a static cache (inductor) takes the one-call path and equals eager,
    which makes two calls."""
    import pid_plugins.core.siblings.twicing as tw
    from zoo_cases import gqa_llama

    model, x = gqa_llama(NAME), hf_ids(vocab=128)[:, :6]
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
              cache_implementation="static")
    one_call, traced = tw._one_call, []
    monkeypatch.setattr(tw, "_one_call", lambda *a: traced.append(1) or one_call(*a))
    with torch.no_grad():
        eager = model.generate(x, **kw)
        assert not traced
        model.forward = torch.compile(model.forward, fullgraph=True)
        compiled = model.generate(x, **kw)
    assert len(traced) >= 4  # traced once per layer of the decoding step's graph
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), rtol=1e-5, atol=1e-5)
