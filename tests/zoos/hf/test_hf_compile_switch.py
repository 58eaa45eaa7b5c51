"""transformers' compile switches, for every method (fixed gains, learnable gains, gain warm-up)."""
from __future__ import annotations

import pytest
import torch

from compile_switch import WARMUP_STEPS, Dynamo, assert_close_state, variants

T = pytest.importorskip("transformers")
import pid_plugins.hf  # noqa: E402,F401
from zoo_cases import hf_ids, llama_config, without_record  # noqa: E402

STEPS = 3


def _backend(method, cfg, training):
    if method == "pid" and not set(cfg) & {"learnable", "warmup_steps"}:
        return "inductor"
    return "aot_eager" if training else "eager"


def _llama(method, cfg, seed=0):
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(llama_config(method, cfg, layers=2))


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n=2 * STEPS):
        self.ids = hf_ids(n, 8, seed=3)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_run(model, out, compile_backend=None):
    """Train ``model`` STEPS SGD steps with the Trainer; (losses, graphs compiled after each step)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from torch._dynamo.utils import counters

    graphs = []

    class Graphs(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            graphs.append(counters["stats"]["unique_graphs"])

    switch = dict(torch_compile=True, torch_compile_backend=compile_backend) if compile_backend else {}
    args = T.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=STEPS, learning_rate=0.5, report_to="none",
        use_cpu=True, save_strategy="no", logging_steps=1, dataloader_num_workers=0, seed=0, disable_tqdm=True,
        lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0, **switch)
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(), callbacks=[Graphs()])
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == STEPS
    return torch.tensor(losses), graphs


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("method,cfg", variants("hf-llama"))
def test_trainer_torch_compile_trains_like_eager(method, cfg, tmp_path):
    backend = _backend(method, cfg, training=True)
    model, twin = _llama(method, cfg), _llama(method, cfg)
    twin.load_state_dict(model.state_dict(), strict=True)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Dynamo() as dynamo:
        got, graphs = _trainer_run(model, tmp_path / "compiled", backend)
        assert dynamo.graph_breaks == {}, dynamo.graph_breaks
        assert graphs == [1] * STEPS, graphs
    want, _ = _trainer_run(twin, tmp_path / "eager")
    tol = dict(rtol=1e-4, atol=1e-5) if backend == "inductor" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    assert_close_state(model.state_dict(), twin.state_dict(), moved_from=before, **tol)
    if "warmup_steps" in cfg:
        counters = [b for n, b in model.named_buffers() if n.endswith("warmup.step")]
        assert counters and all(int(c) == STEPS < WARMUP_STEPS for c in counters)
    if "learnable" in cfg:
        gains = [n for n, _ in model.named_parameters() if "attention_params" in n]
        assert gains and any(not torch.equal(model.state_dict()[n], before[n]) for n in gains)


DECODE = [p for p in variants("hf-llama") if not set(p.values[1]) & {"learnable", "warmup_steps"}]


def _generate(model, n, **kwargs):
    with torch.no_grad():
        out = model.generate(hf_ids(1, 5, seed=4), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    return torch.stack(out.logits)


def _static(method, cfg):
    model = _llama(method, cfg).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.max_cache_len = 32  # one cache size for every call: no recompilation for its shape
    return model


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("switch", ["transformers' compile", "torch.compile(model.forward)"])
@pytest.mark.parametrize("method,cfg", DECODE)
def test_generate_static_cache_compiled_equals_eager_without_recompiles(method, cfg, switch):
    from transformers.generation import CompileConfig

    backend = _backend(method, cfg, training=False)
    model = _static(method, cfg)
    want = _generate(model, 7, disable_compile=True)
    assert not torch.allclose(want, _generate(_static("sdpa", None), 7, disable_compile=True), rtol=0, atol=1e-4)
    with Dynamo() as dynamo:
        if switch == "transformers' compile":
            config = CompileConfig(fullgraph=True, backend=backend, mode="default")
            config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
            kwargs, per_call = dict(compile_config=config), 1
        else:
            model.forward = torch.compile(model.forward, fullgraph=True, backend=backend)
            kwargs, per_call = {}, 2  # the prefill too: a graph of its own
        short = _generate(model, 4, **kwargs)
        assert dynamo.graphs == per_call
        got = _generate(model, 7, **kwargs)  # another decode length: the same graphs
        assert dynamo.graphs == per_call and dynamo.graph_breaks == {}, dynamo.graph_breaks
    tol = dict(rtol=1e-4, atol=1e-5) if backend == "inductor" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(short, want[:4], **tol)
