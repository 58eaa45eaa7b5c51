"""The state rule (core, for every adapter): a layer that is not its group's first never starts a method state silently."""
import pytest
import torch

from method_cases import BUILTIN, CAUSAL_METHODS
from pid_plugins.core import LayerCall, MissingLayerState, get_method
from pid_plugins.core.methods import missing_state_message
from zoo_cases import (DEIT, MM_BACKBONE, bart_config, data_dir, fs_build, fs_method, fs_tokens,  # noqa: F401
                       hf_ids, import_timm, import_transformers, llama_config, mm_build, mm_inputs)

#: the built-in methods with cross-layer state (the method object's state_fields), and those without (Twicing)
STATEFUL = [name for name, method in BUILTIN.items() if method.cross_layer_state]
STATELESS = [name for name, method in BUILTIN.items() if not method.cross_layer_state]


def _attend(q, v):
    return torch.nn.functional.scaled_dot_product_attention(q, q, v)


@pytest.mark.parametrize("name", STATEFUL)
def test_core_a_later_layer_without_state_is_refused_unless_it_restarts(name):
    method = get_method(name)
    config = method.configure(None, "timm")
    q = v = torch.randn(1, 2, 5, 4)
    with pytest.raises(MissingLayerState) as info:
        method.apply(config, None, LayerCall(_attend, q, v, v, layer=2), None)
    message = str(info.value)
    assert f"attention method {name!r}: layer 2 of its group got no state from the layers before it" in message
    assert f"({', '.join(method.state_fields)})" in message
    assert "pipeline parallelism (a stage that starts at layer 2)" in message
    assert "Run the group's layers in one forward of the model" in message  # core's words without a route
    # the adapter's route ends the message; the group's first layer, a call without an index and a restart run
    with pytest.raises(MissingLayerState, match=r"starts at layer 1\)\S* .*my route\.$"):
        method.apply(config, None, LayerCall(_attend, q, v, v, layer=1, state_route="my route."), None)
    first_out, first_state = method.apply(config, None, LayerCall(_attend, q, v, v, layer=0), None)
    for call in (LayerCall(_attend, q, v, v), LayerCall(_attend, q, v, v, layer=3, restart=True)):
        out, state = method.apply(config, None, call, None)
        torch.testing.assert_close(out, first_out, rtol=0, atol=0)  # it starts the state as the first layer does
    # with the previous layer's state a later layer runs
    method.apply(config, None, LayerCall(_attend, q, v, v, layer=1), first_state)


@pytest.mark.parametrize("name", STATELESS)
def test_core_methods_without_cross_layer_state_are_not_affected(name):
    method = get_method(name)
    q = v = torch.randn(1, 2, 5, 4)
    out, state = method.apply(method.configure(None, "timm"), None, LayerCall(_attend, q, v, v, layer=3), None)
    assert state == () and out.shape == q.shape
    assert "attention method 'pid': layer 4" in missing_state_message(get_method("pid"), 4)


# PID stands for the methods with state here (the refusal is core's, checked for each above and in transformers
# below); every method without state runs
@pytest.mark.parametrize("name", ["pid", *STATELESS])
def test_timm_a_block_called_alone_refuses_without_state_and_runs_with_it(name):
    timm = import_timm()
    torch.manual_seed(0)
    model = timm.create_model("pid_deit_tiny_patch16_224", attention=name, **DEIT).eval()
    x = torch.randn(2, 17, DEIT["embed_dim"])
    with torch.no_grad():
        if name in STATELESS:  # no cross-layer state: a block alone is fine
            assert model.blocks[1](x).shape == x.shape and len(model.blocks[1](x, with_state=True)) == 1
            return
        with pytest.raises(MissingLayerState, match=r"'pid': layer 1 of its group.*With timm, build the model by its "
                                                    r"pid_\* name.*x, \*state = block\(x, \*state, with_state=True\)"):
            model.blocks[1](x)
        # the state threaded by hand (what a pipeline stage hands on) gives the model's own features
        images = torch.randn(2, 3, DEIT["img_size"], DEIT["img_size"])
        h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))
        h, *state = model.blocks[0](h, with_state=True)
        for blk in model.blocks[1:]:
            h, *state = blk(h, *state, with_state=True)
        torch.testing.assert_close(model.norm(h), model.forward_features(images), rtol=0, atol=0)


def test_mmseg_a_layer_called_alone_refuses_without_state():
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm

    backbone = mm_build("PIDVisionTransformer", MM_BACKBONE, attention="pid")
    assert isinstance(backbone, pm.PIDVisionTransformer)
    backbone.eval()
    x = torch.randn(2, 17, MM_BACKBONE["embed_dims"])
    with torch.no_grad():
        y, state = backbone.layers[0](x)
        backbone.layers[1](y, state)
        with pytest.raises(MissingLayerState, match=r"'pid': layer 1 of its group.*With mmseg, run the layers "
                                                    r"through the backbone's"):
            backbone.layers[1](y)


def test_fairseq_layer_dropout_restarts_the_state_and_a_layer_alone_is_refused(data_dir):
    """``--decoder-layerdrop``: fairseq's LayerDropModuleList skips layers in training; a forward whose first layers
    were skipped starts the state at the first layer that runs (as before the rule), never an error."""
    model, _, _ = fs_build(data_dir, extra=fs_method("pid") + ["--decoder-layerdrop", "0.5"])
    ran = []
    for index in range(3):
        model.decoder.layers[index].register_forward_pre_hook(lambda m, a, i=index: ran[-1].append(i))
    model.train()
    toks = fs_tokens()
    for seed in range(12):
        torch.manual_seed(seed)
        ran.append([])
        model(toks)[0].sum().backward()
    assert any(r and r[0] > 0 for r in ran), ran  # a forward whose first layer was dropped, and a later one ran
    model.eval()
    x = torch.randn(10, 2, 32)
    with torch.no_grad(), pytest.raises(MissingLayerState, match=r"'pid': layer 1 of its group.*With fairseq, run "
                                                                  r"the layers through the decoder's own forward"):
        model.decoder.layers[1](x)


def _hand_split(model, owned):
    """What a user builds for torch.distributed.pipelining by hand (and what each stage of transformers' own PP
    runs): the layers another stage owns replaced by an identity."""
    class Identity(torch.nn.Module):
        def forward(self, hidden_states, *args, **kwargs):
            return hidden_states

    for i in range(len(model.model.layers)):
        if i not in owned:
            model.model.layers[i] = Identity()
    return model


@pytest.mark.parametrize("name", list(BUILTIN))
def test_hf_a_stage_that_starts_mid_stack_without_the_state_is_refused(name):
    T = import_transformers()
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config(name, CAUSAL_METHODS[name], layers=4)).eval()
    _hand_split(model, owned={2, 3})
    h = torch.randn(2, 8, 32)
    with torch.no_grad():
        if name in STATELESS:  # no cross-layer state: the stage runs
            assert model(inputs_embeds=h).logits.shape == (2, 8, 96)
            return
        with pytest.raises(MissingLayerState) as info:
            model(inputs_embeds=h)
    message = str(info.value)
    assert f"attention method {name!r}: layer 2 of its group got no state" in message
    assert "pipeline parallelism (a stage that starts at layer 2)" in message
    assert "pid_plugins.hf.pipeline_stage(model, stage_index, num_stages)" in message
    assert "DistributedConfig(pp_size=...) is refused" in message


def test_hf_layer_dropout_restarts_the_state_in_training_and_never_refuses():
    """BART's ``encoder_layerdrop`` in training: a forward whose first encoder layers were skipped starts the state
    at the first layer that runs (documented), as before the rule."""
    T = import_transformers()
    torch.manual_seed(0)
    model = T.BartModel(bart_config(attn_implementation="pid", encoder_layerdrop=0.5,
                                    decoder_layerdrop=0.5, dropout=0.0, attention_dropout=0.0)).train()
    ran = []
    for index, layer in enumerate(model.encoder.layers):
        layer.register_forward_pre_hook(lambda m, a, i=index: ran[-1].append(i))
    x = hf_ids()
    for seed in range(12):
        torch.manual_seed(seed)
        ran.append([])
        model(input_ids=x, decoder_input_ids=x).last_hidden_state.sum().backward()
    assert any(r and r[0] > 0 for r in ran), ran
