"""``pid_plugins.finish_warmup(model)`` where transformers' models nest (T5's stacks) or are wrapped (peft); the zoo
contract (tests/core/test_zoo_contract.py) runs it on a Llama and BERT with every method that warms up."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402

import pid_plugins  # noqa: E402
import pid_plugins.hf  # noqa: E402,F401
from pid_plugins.testing import MODELS  # noqa: E402
from zoo_cases import hf_ids  # noqa: E402

N = 3
LLAMA = MODELS["hf-llama"]


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def test_nested_models_read_no_counter_after_finishing():
    """T5's stacks keep deep copies of the config and read the outer model's counter."""
    config = T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        decoder_start_token_id=0, pad_token_id=0)
    config._attn_implementation, config.pid = "pid", {"warmup_steps": N}
    torch.manual_seed(0)
    model = T.T5ForConditionalGeneration(config).eval()
    x = hf_ids()
    model.train()
    for _ in range(N + 1):
        model(input_ids=x, labels=x)
    model.eval()
    with torch.no_grad():
        want = model(input_ids=x, labels=x).logits
    pid_plugins.finish_warmup(model)
    assert not any("attention_warmup" in k for k in model.state_dict())
    assert all(m.config.pid["warmup_steps"] == 0 for m in model.modules() if isinstance(m, T.PreTrainedModel))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x, labels=x).logits, want)


def test_under_peft_with_the_counter_in_the_adapter():
    peft = pytest.importorskip("peft")
    model = LLAMA.build("pid", {"learnable": True, "warmup_steps": N})
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         modules_to_save=["attention_params", "attention_warmup"]))
    opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.1)
    wrapped.train()
    for _ in range(N + 1):
        opt.zero_grad()
        LLAMA.loss(wrapped, hf_ids(seed=2)).backward()
        opt.step()
    wrapped.eval()
    assert int(wrapped.attention_warmup.step) == N + 1
    x = hf_ids()
    want = logits(wrapped, x)
    assert pid_plugins.finish_warmup(wrapped) is wrapped
    assert not any("attention_warmup" in k for k in wrapped.state_dict())
    assert wrapped.base_model.model.config.pid["warmup_steps"] == 0
    assert torch.equal(logits(wrapped, x), want)
    merged = wrapped.merge_and_unload()
    torch.testing.assert_close(logits(merged, x), want, rtol=1e-5, atol=1e-5)  # merging LoRA rounds differently
