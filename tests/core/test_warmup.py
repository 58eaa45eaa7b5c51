"""Gain warm-up, PIDConfig(warmup_steps=N), in every zoo: the PID term scaled by min(1, t/N), t counting the whole
model's training-mode forward passes (a buffer in its state_dict)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pid_plugins import GainWarmup, PIDConfig
from pid_plugins.core import scaled_gains
import zoo_cases as zc

N = 4
GAINS = dict(lambda_p=0.6, lambda_i=0.4, lambda_d=0.2, beta=0.5)
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]  # the checkout under test, also for fairseq-train subprocesses


def test_config_field_round_trips_and_refuses_bad_values():
    cfg = PIDConfig(warmup_steps=10)
    assert PIDConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["warmup_steps"] == 10
    assert PIDConfig.from_dict({"lambda_p": 0.3}).warmup_steps == 0  # dicts saved before the field parse
    assert PIDConfig.coerce({"warmup_steps": 5}, default="lm") == PIDConfig.preset("lm", warmup_steps=5)
    for bad in (-1, 2.5, True, "3", None):
        with pytest.raises(ValueError, match="warmup_steps must be a whole number"):
            PIDConfig(warmup_steps=bad)


def test_counter_schedule_eval_and_missing_key():
    counter = GainWarmup(N)
    assert [float(counter()) for _ in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    counter.eval()
    assert float(counter()) == 1.0 and int(counter.step) == 6  # eval forwards do not advance t
    fresh = GainWarmup(N)
    fresh.step.fill_(3)
    fresh.load_state_dict({}, strict=True)  # a state_dict without the counter: t starts at 0
    assert int(fresh.step) == 0
    assert "step" in dict(fresh.named_buffers())  # a buffer: DDP broadcasts it, so every rank has rank 0's t
    assert scaled_gains(PIDConfig(), None) == PIDConfig()  # no warm-up: fixed gains stay floats (fast path)
    with pytest.raises(ValueError, match="warmup_steps > 0"):
        GainWarmup(0)


#: the contract's tiny models (tests/method_cases.py): each zoo's builder, inputs and output (FAN at 32 pixels)
ZOOS = {"timm_vit": "timm-deit", "timm_fan": "timm-fan", "hf": "hf-llama", "mmseg_backbone": "mmseg-backbone",
        "mmseg_head": "mmseg-head", "fairseq": "fairseq-lm"}
CHECKPOINTING = [z for z in ZOOS if z != "fairseq"]  # transformer_lm_pid refuses --checkpoint-activations
FAN32 = {"fan": ("pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224", dict(zc.FAN, img_size=32, num_heads=3))}


class Zoo:
    def __init__(self, zoo):
        from method_cases import MODELS

        self.zoo, self.case = zoo, MODELS[ZOOS[zoo]]

    def build(self, pid, seed=0, attention="pid"):
        torch.manual_seed(seed)
        if self.zoo == "hf":  # (the contract's pair loads the method model's weights into the stock one)
            return zc.import_transformers().LlamaForCausalLM(zc.llama_config(attention, pid)).eval()
        if self.zoo == "timm_fan":
            return zc.import_timm().create_model(FAN32["fan"][0], attention=attention, attention_cfg=pid,
                                                 **FAN32["fan"][2]).eval()
        return self.case.build(attention, pid, seed)

    def stock(self):
        return self.build(None, attention="sdpa" if self.zoo == "hf" else "softmax")

    def inputs(self, dtype=torch.float32):
        return zc.timm_images("fan", models=FAN32).to(dtype) if self.zoo == "timm_fan" else self.case.inputs(dtype)

    def out(self, model, x):
        return self.case.out(model, x)

    def counter(self, model):
        return (model.decoder if self.zoo == "fairseq" else model).attention_warmup

    def enable_checkpointing(self, model):
        if self.case.zoo == "timm":
            model.set_grad_checkpointing(True)
        elif self.zoo == "hf":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            for layer in model.layers:
                layer.with_cp = True


def without_counter(state_dict):
    return {k: v for k, v in state_dict.items() if "attention_warmup" not in k}


def warm_and_stock(zoo, dtype=torch.float32):
    """A warm-up model and the stock model with the same weights (the stock state_dict loads strictly: t = 0)."""
    warm, stock = zoo.build(dict(GAINS, warmup_steps=N)).to(dtype), zoo.stock().to(dtype)
    zoo.counter(warm).step.fill_(3)
    warm.load_state_dict(stock.state_dict(), strict=True)  # a softmax checkpoint: no counter in it
    assert int(zoo.counter(warm).step) == 0
    return warm, stock


@pytest.mark.parametrize("zoo", ZOOS)
def test_t0_is_the_stock_model_and_each_training_forward_counts_once(zoo):
    zoo = Zoo(zoo)
    warm, stock = warm_and_stock(zoo)
    key = ("decoder." if zoo.zoo == "fairseq" else "") + "attention_warmup.step"
    assert key in warm.state_dict() and key in dict(warm.named_buffers())  # DDP broadcasts buffers
    assert not any("attention_warmup" in k for k in zoo.build(GAINS).state_dict())  # no warm-up: state_dict unchanged
    x = zoo.inputs()
    warm.train()
    stock.train()
    assert torch.equal(zoo.out(warm, x), zoo.out(stock, x))  # t = 0: bit for bit
    assert int(zoo.counter(warm).step) == 1
    assert not torch.allclose(zoo.out(warm, x), zoo.out(stock, x))  # t = 1: the PID term is on
    warm.eval()
    with torch.no_grad():
        zoo.out(warm, x)
    assert int(zoo.counter(warm).step) == 2  # eval forwards do not count


@pytest.mark.parametrize("zoo", ZOOS)
def test_t_k_is_the_model_with_gains_scaled_by_k_over_n(zoo):
    zoo = Zoo(zoo)
    warm, _ = warm_and_stock(zoo, torch.float64)
    warm.eval()
    x = zoo.inputs(torch.float64)
    for k in (1, 3, N, N + 2):
        zoo.counter(warm).step.fill_(k)
        s = min(1.0, k / N)
        ref = zoo.build({**GAINS, **{g: GAINS[g] * s for g in ("lambda_p", "lambda_i", "lambda_d")}}).double()
        ref.load_state_dict(without_counter(warm.state_dict()), strict=True)
        ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(zoo.out(warm, x), zoo.out(ref, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("zoo", CHECKPOINTING)
def test_gradient_checkpointing_counts_one_step_per_forward(zoo):
    zoo = Zoo(zoo)
    warm, _ = warm_and_stock(zoo)
    plain = zoo.build(dict(GAINS, warmup_steps=N))
    plain.load_state_dict(warm.state_dict(), strict=True)
    zoo.enable_checkpointing(warm)
    x = zoo.inputs()
    for model in (warm, plain):
        model.train()
        for _ in range(2):  # t = 0 and t = 1
            zoo.out(model, x).float().square().mean().backward()
    assert int(zoo.counter(warm).step) == int(zoo.counter(plain).step) == 2  # recomputation did not count
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    for n, p in warm.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6)


def test_timm_learnable_gains_are_scaled_too():
    import torch.nn.functional as F

    from pid_plugins.core.pid import _inverse_softplus

    zoo = Zoo("timm_vit")
    torch.manual_seed(0)
    warm = zoo.build(dict(GAINS, learnable=True, warmup_steps=N)).double().eval()
    x = zoo.inputs(torch.float64)
    zoo.counter(warm).step.fill_(1)
    ref = zoo.build(dict(GAINS, learnable=True)).double().eval()
    ref.load_state_dict(without_counter(warm.state_dict()), strict=True)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("_raw"):
                p.copy_(torch.tensor([_inverse_softplus(float(F.softplus(p)) / N)], dtype=torch.float64))
        torch.testing.assert_close(warm(x), ref(x), rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("zoo", ["timm_vit", "hf"])
def test_compiled_model_does_not_recompile_as_t_advances(zoo):
    import torch._dynamo

    zoo = Zoo(zoo)
    warm, _ = warm_and_stock(zoo)
    eager = zoo.build(dict(GAINS, warmup_steps=N))
    eager.load_state_dict(warm.state_dict(), strict=True)
    warm.train()
    eager.train()
    compiled = torch.compile(warm, backend="aot_eager", fullgraph=zoo.zoo == "timm_vit")
    x = zoo.inputs()
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(N + 1):
                torch.testing.assert_close(zoo.out(compiled, x), zoo.out(eager, x), rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()
    assert int(zoo.counter(warm).step) == int(zoo.counter(eager).step) == N + 1


def test_timm_checkpoint_and_pretrained_softmax_file(tmp_path):
    from timm.models import load_checkpoint, resume_checkpoint

    zoo = Zoo("timm_vit")
    warm, stock = warm_and_stock(zoo)
    warm.train()
    zoo.out(warm, zoo.inputs())
    torch.save({"state_dict": warm.state_dict(), "epoch": 0}, tmp_path / "last.pth.tar")
    resumed = zoo.build(dict(GAINS, warmup_steps=N))
    resume_checkpoint(resumed, str(tmp_path / "last.pth.tar"))  # train.py --resume
    assert int(resumed.attention_warmup.step) == 1
    load_checkpoint(resumed, str(tmp_path / "last.pth.tar"), strict=True)
    assert int(resumed.attention_warmup.step) == 1
    torch.save(stock.state_dict(), tmp_path / "softmax.pth")  # a softmax checkpoint as pretrained weights
    name, _, args = zc.TIMM["deit"]
    model = zc.timm_load_pretrained(name, tmp_path / "softmax.pth", attention_cfg=dict(GAINS, warmup_steps=N), **args)
    assert int(model.attention_warmup.step) == 0
    model.train()
    stock.train()
    # (num_classes differs from the pretrained cfg's: timm keeps the new head's init, so compare the features)
    assert torch.equal(model.forward_features(zoo.inputs()), stock.forward_features(zoo.inputs()))


def test_hf_save_pretrained_round_trip_old_checkpoints_and_one_counter_per_model(tmp_path, caplog):
    import pid_plugins.hf  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

    zoo = Zoo("hf")
    warm, stock = warm_and_stock(zoo)
    # on the outermost model
    assert [k for k in warm.state_dict() if "attention_warmup" in k] == ["attention_warmup.step"]
    warm.train()
    x = zoo.inputs()
    for _ in range(3):
        zoo.out(warm, x)
    warm.save_pretrained(tmp_path / "warm")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "warm")
    assert int(back.attention_warmup.step) == 3 and back.config.pid["warmup_steps"] == N
    back.train()
    torch.testing.assert_close(zoo.out(back, x), zoo.out(warm, x), rtol=0, atol=0)
    # a softmax checkpoint: the counter is missing, from_pretrained starts it at 0, without a warning
    stock.save_pretrained(tmp_path / "stock")
    config = LlamaConfig.from_pretrained(tmp_path / "stock")
    config.pid = dict(GAINS, warmup_steps=N)
    empty_like = torch.empty_like

    def poisoned(tensor, *args, **kwargs):  # what transformers gives a missing key, made visibly wrong
        out = empty_like(tensor, *args, **kwargs)
        return out.fill_(12345) if out.dtype == torch.long else out

    with caplog.at_level("WARNING"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty_like", poisoned)
        model = LlamaForCausalLM.from_pretrained(tmp_path / "stock", config=config, attn_implementation="pid")
    assert int(model.attention_warmup.step) == 0
    assert "attention_warmup" not in caplog.text
    model.train()
    stock.train()
    assert torch.equal(zoo.out(model, x), zoo.out(stock, x))
    # an encoder-decoder: one counter (on the outermost model), one step per forward of the whole model
    t5 = T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0)
    t5.pid = {"warmup_steps": N}
    t5._attn_implementation = "pid"
    seq2seq = T5ForConditionalGeneration(t5).train()
    assert [k for k in seq2seq.state_dict() if "attention_warmup" in k] == ["attention_warmup.step"]
    ids = torch.randint(1, 40, (2, 6))
    seq2seq(input_ids=ids, labels=ids).loss.backward()
    assert int(seq2seq.attention_warmup.step) == 1


def test_hf_convert_adds_the_counter_and_refuses_a_model_without_one():
    pytest.importorskip("transformers")
    import pid_plugins.hf as ph

    zoo = Zoo("hf")
    model = zoo.stock()
    model.config.pid = {"warmup_steps": N}
    model.set_attn_implementation("pid")  # a stock model switched without convert: refused, naming convert
    with pytest.raises(RuntimeError, match=r"Call pid_plugins\.hf\.convert\(model, 'pid'\) once"):
        zoo.out(model, zoo.inputs())
    ph.convert(model, "pid")
    assert int(model.attention_warmup.step) == 0 and model.attention_warmup.warmup_steps == N


@pytest.mark.integration
@pytest.mark.slow
def test_fairseq_train_checkpoint_resumes_the_schedule(tmp_path, tiny_fairseq_data_bin):
    import pid_plugins.fairseq as pf

    def run(cmd):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([str(BIN / cmd[0]), *map(str, cmd[1:])], cwd=tmp_path, capture_output=True, text=True,
                              timeout=900, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]

    train = ["fairseq-train", tiny_fairseq_data_bin, "--task", "language_modeling", "--user-dir", pf.USER_DIR, "--arch",
             "transformer_lm_pid", *zc.fs_tiny(), "--max-tokens", "128", "--optimizer", "adam", "--lr", "0.001",
             "--cpu", "--num-workers", "0", "--save-dir", "ck", "--no-epoch-checkpoints",
             "--attention-cfg", '{"warmup_steps": 10}']
    run([*train, "--max-update", "2"])
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    # 2 updates, 2 training forwards (validation: eval)
    assert int(state["model"]["decoder.attention_warmup.step"]) == 2
    assert json.loads(state["cfg"]["model"]["attention_cfg"]) == {"warmup_steps": 10}
    run([*train, "--max-update", "3"])  # resumes from ck/checkpoint_last.pt
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert int(state["model"]["decoder.attention_warmup.step"]) == 3
    hub = pf.load_pid_lm(str(tmp_path / "ck" / "checkpoint_last.pt"), str(tiny_fairseq_data_bin))
    counter = hub.models[0].decoder.attention_warmup
    assert int(counter.step) == 3 and counter.warmup_steps == 10
