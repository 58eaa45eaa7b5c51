"""Pipeline parallelism with every attention method (transformers): ``pid_plugins.hf.pipeline_stage`` carries the
method's state across stage boundaries as tensors: in one process (splits of 2 and 3, a reference-only first layer's
None field, checkpointing) logits and gradients equal the whole model; on 2 ranks under
``torch.distributed.pipelining`` (GPipe) logits and 2 SGD steps equal one process."""
import sys
from pathlib import Path

import pytest
import torch

from method_cases import BUILTIN
from pid_plugins.core import get_method

HERE = Path(__file__).resolve().parents[1]  # tests/
DIST = HERE / "dist_workers"
sys.path.insert(0, str(DIST))
import pid_dist_cases as cases  # noqa: E402

T = pytest.importorskip("transformers")
import pid_plugins.hf as ph  # noqa: E402

ONE_PROCESS = {**cases.PIPELINE_METHODS, "pid_reference_first": ("pid", {"control_first_layer": False}),
               "softmax": ("sdpa", None)}


def build(case: str):
    name, params = ONE_PROCESS[case]
    torch.manual_seed(0)
    return T.LlamaForCausalLM(cases.pipeline_config(name, params)).train(False)


def run_stages(stages, ids, **kwargs):
    out = stages[0](ids, **kwargs)
    for stage in stages[1:]:
        out = stage(*out, **kwargs)
    return out


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", list(ONE_PROCESS))
def test_stages_in_one_process_equal_the_whole_model(case):
    ids, mask = cases.pipeline_batch(-1)
    whole = build(case).train()
    want = whole(ids, attention_mask=mask).logits
    cases.pipeline_loss(want, ids).backward()
    want_grads = grads(whole)
    name = ONE_PROCESS[case][0]
    fields = get_method(name).state_fields if name != "sdpa" else ()
    for split in ([(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]):
        models = [build(case).train() for _ in split]
        stages = [ph.pipeline_stage(m, i, len(split), layer_range=r) for i, (m, r) in enumerate(zip(models, split))]
        assert [s.state_fields() for s in stages] == [fields] * len(split)
        boundary = stages[0](ids, attention_mask=mask)
        assert len(boundary) == 1 + len(fields) and all(t.is_contiguous() for t in boundary)
        if name == "elliptical":  # its state carries no gradient (computed under no_grad in the official code)
            assert not boundary[1].requires_grad
        if case == "pid_reference_first" and split[0] == (0, 1):  # no error formed yet: None travels as empty
            assert [t.numel() for t in boundary[2:]] == [0, 0]
        logits = run_stages(stages, ids, attention_mask=mask)
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-6)
        cases.pipeline_loss(logits, ids).backward()
        got = {}
        for model in models:
            got.update(grads(model))
        assert set(got) == set(want_grads)
        for key in want_grads:
            torch.testing.assert_close(got[key], want_grads[key], rtol=1e-5, atol=1e-7, msg=key)


def test_stages_with_gradient_checkpointing_equal_the_whole_model():
    ids, _ = cases.pipeline_batch(0)
    whole = build("pid_learnable").train()
    cases.pipeline_loss(whole(ids).logits, ids).backward()
    models = [build("pid_learnable").train() for _ in range(2)]
    for model in models:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    stages = [ph.pipeline_stage(m, i, 2) for i, m in enumerate(models)]
    cases.pipeline_loss(run_stages(stages, ids), ids).backward()
    got = {**grads(models[0]), **grads(models[1])}
    want = grads(whole)
    assert set(got) == set(want) and any(".attention_params." in k for k in got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)


def test_a_stage_keeps_only_its_modules_and_checks_its_inputs():
    models = [build("pid") for _ in range(2)]
    first, last = (ph.pipeline_stage(m, i, 2) for i, m in enumerate(models))
    assert (first.layer_range, last.layer_range) == ((0, 2), (2, 4)) and ph.stage_layer_range(1, 3, 4) == (2, 3)
    assert any("embed_tokens" in n for n, _ in first.named_parameters())
    assert not any(n.startswith(("model.lm_head", "model.model.norm")) for n, _ in first.named_parameters())
    assert any(n.startswith("model.lm_head") for n, _ in last.named_parameters())
    assert {n.split(".")[3] for n, _ in first.named_parameters() if ".layers." in n} == {"0", "1"}
    assert {n.split(".")[3] for n, _ in last.named_parameters() if ".layers." in n} == {"2", "3"}
    assert not any("embed_tokens" in n for n, _ in last.named_parameters())
    hidden = torch.randn(2, 5, 32)
    with pytest.raises(TypeError, match=r"stage 1 takes \(hidden_states, \*state\) with the state of attention method "
                                        r"'pid': 4 tensors \(hidden_states, v_first, e_sum, e_prev\); got 1"):
        last(hidden)
    with pytest.raises(TypeError, match="labels= is not a stage keyword"):
        first(torch.ones(2, 5, dtype=torch.long), labels=None)


def test_pipeline_stage_refusals():
    with pytest.raises(ValueError, match=r"has no base_model.layers .* decoder-only family"):
        ph.pipeline_stage(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                                         attn_implementation="pid")), 0, 2)
    with pytest.raises(ValueError, match=r"stage_index must be in \[0, num_stages\), got 2 of 2"):
        ph.pipeline_stage(build("pid"), 2, 2)
    with pytest.raises(ValueError, match=r"stage 1 must own at least one of the 4 layers; got layers \[4, 4\)"):
        ph.pipeline_stage(build("pid"), 1, 2, layer_range=(4, 4))
    with pytest.raises(ValueError, match=r"the first stage starts at layer 0"):
        ph.pipeline_stage(build("pid"), 0, 2, layer_range=(1, 2))
    torch.manual_seed(0)
    warm = T.LlamaForCausalLM(cases.pipeline_config("pid", {"warmup_steps": 4}))
    with pytest.raises(ValueError, match=r"warms its 'pid' parameters up .* finish the warm-up first"):
        ph.pipeline_stage(warm, 0, 2)
    model = build("pid")
    ph.pipeline_stage(model, 1, 2)
    with pytest.raises(ValueError, match="is a pipeline stage already"):
        ph.pipeline_stage(model, 0, 2)
    with pytest.raises(ValueError, match=r"LlamaModel.embed_tokens belongs to another pipeline stage .* choose the method"):
        ph.convert(model, "pid")  # the layers cannot be numbered again once the other stages' are gone


def _with_pp(model):
    """What ``from_pretrained(..., distributed_config=DistributedConfig(pp_size=2))`` records on the config (the
    2-rank test below runs the real thing)."""
    from transformers.distributed import DistributedConfig

    model.config.distributed_config = DistributedConfig(pp_size=2)
    return model


@pytest.mark.parametrize("case", list(BUILTIN))
def test_transformers_pp_is_refused_at_the_first_forward_for_methods_with_cross_layer_state(case):
    model = _with_pp(build(case))
    ids = torch.ones(1, 4, dtype=torch.long)
    if not BUILTIN[case].cross_layer_state:  # Twicing: runs
        assert model(ids).logits.shape == (1, 4, 96)
        return
    name = cases.PIPELINE_METHODS[case][0]
    with pytest.raises(ValueError) as info:
        model(ids)
    assert str(info.value) == _pp_message(name)
    with pytest.raises(ValueError, match=r"pipeline parallelism \(transformers' DistributedConfig\(pp_size=2\)\)"):
        ph.convert(_with_pp(build("softmax")), name)  # a PP model converted: refused before anything changes
    zero = {"lambda_p": 0.0, "lambda_i": 0.0, "lambda_d": 0.0}  # PID computing the stock attention: runs
    ph.convert(_with_pp(build("softmax")), "pid", zero)(ids)


def _pp_message(name: str, registered=None) -> str:
    """The refusal, word for word."""
    from pid_plugins.core import list_methods

    registered = list_methods() if registered is None else registered
    carrying = ", ".join(n for n in registered if get_method(n).state_fields)
    free = ", ".join(n for n in registered if not get_method(n).state_fields)
    fields = ", ".join(get_method(name).state_fields)
    return (
        f"attn_implementation={name!r}: pipeline parallelism (transformers' DistributedConfig(pp_size=2)) is refused "
        f"for the attention methods that carry state across layers ({carrying}): each stage runs a forward of its own "
        "and receives only the previous stage's hidden states, so the first layer of a later stage would lose the "
        f"state of the layers before it ({fields} for {name!r}) and silently take itself for the first layer. Methods "
        f"without cross-layer state ({free}) run under it. The supported route: split the model with "
        "pid_plugins.hf.pipeline_stage(model, stage_index, num_stages) and run the stages with "
        "torch.distributed.pipelining (PipelineStage and a schedule such as ScheduleGPipe): they carry the method's "
        "state across the stage boundary as tensors"
    )


@pytest.mark.integration
@pytest.mark.engines
@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_torch_pipelining_on_two_ranks_equals_one_process(tmp_path):
    """Every method: the logits of a padded batch (the mask given to every rank) and 2 SGD steps of GPipe with 2
    microbatches (losses, and every parameter of both stages, learnable gains included) against one process."""
    from test_distributed import launch, load_ranks

    launch(tmp_path, "hf_pipeline", [str(DIST / "hf_pipeline.py"), str(tmp_path)], timeout=300)
    r0, r1 = load_ranks(tmp_path)
    ids, mask = cases.pipeline_batch(-1)
    for case, (name, _) in cases.PIPELINE_METHODS.items():
        first, last = r0["runs"][case], r1["runs"][case]
        assert first["state_fields"] == last["state_fields"] == get_method(name).state_fields
        model = cases.pipeline_llama(case).eval()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            torch.testing.assert_close(last["logits"], model(ids, attention_mask=mask).logits, rtol=0, atol=1e-6,
                                       msg=lambda m, c=case: f"{c}: {m}")
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=cases.PIPELINE_LR)
        losses = []
        for step in range(cases.PIPELINE_STEPS):
            batch, _ = cases.pipeline_batch(step)
            opt.zero_grad()
            loss = cases.pipeline_loss(model(batch).logits, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(losses), rtol=1e-6, atol=1e-6)
        params = {**first["params"], **last["params"]}
        assert set(params) == set(init) and set(first["params"]).isdisjoint(last["params"])
        for key, value in model.named_parameters():
            torch.testing.assert_close(params[key], value.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, c=case, k=key: f"{c} {k}: {m}")
        moved = max((params[k] - init[k]).abs().max().item() for k in init)
        assert moved > 1e-2
        if case == "pid_learnable":  # the gains of both stages trained
            for stage in (first, last):
                gains = [k for k in stage["params"] if ".attention_params." in k]
                assert gains and max((stage["params"][k] - init[k]).abs().max().item() for k in gains) > 1e-6


@pytest.mark.integration
@pytest.mark.engines
@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_transformers_pp_on_two_ranks_refuses_state_methods_and_runs_twicing_exactly(tmp_path):
    from test_distributed import launch, load_ranks

    torch.manual_seed(0)
    T.LlamaForCausalLM(cases.pipeline_config()).save_pretrained(tmp_path / "llama")
    launch(tmp_path, "hf_pp", [str(DIST / "hf_pp.py"), str(tmp_path / "llama"), str(tmp_path)], timeout=300)
    r0, r1 = load_ranks(tmp_path)
    ids, mask = cases.pipeline_batch(-1)
    for case in r0["runs"]:
        runs = r0["runs"][case], r1["runs"][case]
        name, params = cases.PP_CASES[case]
        if get_method(name).state_fields:  # refused while built: no rank holds a model
            builtin = sorted(BUILTIN)  # what a worker registers (list_methods: sorted)
            assert [run.get("refused") for run in runs] == [_pp_message(name, builtin)] * 2
            assert not any("owned_layers" in run for run in runs)
            continue
        assert [run["owned_layers"] for run in runs] == [["0", "1"], ["2", "3"]]  # each rank holds its stage only
        config = T.AutoConfig.from_pretrained(tmp_path / "llama")
        setattr(config, name, params)  # the method's parameters: config.<method>
        model = T.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", config=config,
                                                       attn_implementation=name).eval()
        with torch.no_grad():
            want = model(ids, attention_mask=mask).logits
            for run in runs:
                assert "refused" not in run
                torch.testing.assert_close(run["logits"], want, rtol=0, atol=1e-6)
            if "generated" in runs[0]:
                tokens = model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False,
                                        pad_token_id=0)
                assert all(torch.equal(run["generated"], tokens) for run in runs)
