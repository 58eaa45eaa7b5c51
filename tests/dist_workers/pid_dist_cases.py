"""Models, data and training loops shared by the distributed workers in this folder and tests/core/test_distributed.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TIMM_NAME = "pid_deit_tiny_patch16_224"
TIMM_TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=10)
TIMM_GLOBAL_BATCH = 8
TIMM_STEPS = 4
TIMM_LR = 0.05


TIMM_WARMUP_STEPS = 3  # the gain warm-up run: t passes N within TIMM_STEPS


def timm_model(seed: int = 0, warmup_steps: int = 0):
    """A tiny PID DeiT with learnable gains (so the gains are DDP-synchronised parameters too), optionally with
    gain warm-up (its counter a buffer DDP broadcasts)."""
    import timm
    import pid_plugins.timm  # noqa: F401  (registers the pid_* models)

    torch.manual_seed(seed)
    return timm.create_model(TIMM_NAME, attention_cfg=dict(learnable=True, warmup_steps=warmup_steps), **TIMM_TINY)


def timm_batch(step: int):
    """The global batch of `step`: images [8, 3, 32, 32] and labels [8]."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TIMM_GLOBAL_BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, TIMM_TINY["num_classes"], (TIMM_GLOBAL_BATCH,), generator=g)
    return x, y


def timm_optimizer(params):
    return torch.optim.SGD(params, lr=TIMM_LR, momentum=0.9)


HF_ROWS = 32
HF_PER_RANK = 4
HF_STEPS = 3
HF_LR = 0.5  # plain SGD (optim='sgd'): linear in the gradient, so one process reproduces DDP closely
HF_MAX_GRAD_NORM = 0.0  # no clipping: the single-process reference needs no global-norm bookkeeping


def hf_rows():
    return token_rows(HF_ROWS, seed=5)


class HFRows(torch.utils.data.Dataset):
    """:func:`hf_rows` as the Trainer's dataset, recording the row indices its sampler gave this rank."""

    def __init__(self) -> None:
        self.ids = hf_rows()
        self.seen = []  # row indices in the order the Trainer's sampler gave them to this rank

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        self.seen.append(int(i))
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama_config(layers: int = 2, learnable: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                       attn_implementation="pid", **({"pid": {"learnable": True}} if learnable else {}))


def llama_model(seed: int = 0, layers: int = 2, learnable: bool = False):
    import pid_plugins.hf  # noqa: F401  (registers attn_implementation="pid")
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(layers, learnable))


HF_FSDP_LAYERS = 4  # the Trainer + FSDP2 run: a state lost between layers shows from the third layer on


def token_rows(n: int, length: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (n, length), generator=g)


# One tiny model per zoo and family kind: the model (seeded), the layers fully_shard takes before the root, a global
# batch (dim 0), the forward the loss reads, and the zoo's checkpointing switch (None: refused).
FSDP_GLOBAL_BATCH = 4
FSDP_LR = 0.5  # plain SGD: linear in the gradient, so FSDP's averaged gradient is comparable with one process
FSDP_MODES = {  # name: (reshard_after_forward, gradient checkpointing); "ddp": DistributedDataParallel instead
    "reshard": (True, False),
    "keep_unsharded": (False, False),
    "checkpointing": (True, True),
    "ddp": (None, False),
}
TOY_GAMMA = 0.3  # the toy method's strength in the scaled_reference:* cases


def _tests_importable() -> None:
    """tests/ on sys.path (a worker starts with this folder only): its toy method and its method table."""
    tests = str(Path(__file__).resolve().parents[1])
    if tests not in sys.path:
        sys.path.insert(0, tests)


def toy_method():
    """Register the tests' toy method (tests/toy_method.py) in this process, as a user's code would."""
    _tests_importable()
    import toy_method as toy

    return toy


def method_table():
    """tests/method_cases.py, the one method table (its ``CAUSAL_METHODS``: every built-in method with the parameters
    a causal model runs it with)."""
    _tests_importable()
    import method_cases

    return method_cases


#: the suffix of a case's method that asks for its learnable parameters (``pid_learnable``: PID with learnable=True)
LEARNABLE = "_learnable"


def learnable_methods() -> list:
    """The built-in methods with per-layer learnable parameters (tests/method_cases.py)."""
    return [name for name, method in method_table().BUILTIN.items() if method.learnable]


def _hf(kind: str, method=None):
    import pid_plugins.hf  # noqa: F401  (registers attn_implementation="pid")
    import transformers as T

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  max_position_embeddings=32, pad_token_id=0, attn_implementation="pid")
    learnable = {"pid": {"learnable": True}}
    if method is not None:  # another attention method (a registered sibling of PID, or the tests' toy)
        name, params = method
        common, learnable = {**common, "attn_implementation": name, name: params}, {}
    if kind == "decoder":  # Llama with grouped-query attention, 4 layers (a copied state would show from layer 2),
        # learnable gains (parameters of each attention module, so fully_shard per layer shards them with it)
        return T.LlamaForCausalLM(T.LlamaConfig(**common, num_hidden_layers=4, num_key_value_heads=2, **learnable))
    if kind == "encoder":
        return T.BertModel(T.BertConfig(**common, num_hidden_layers=3, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0), add_pooling_layer=False)
    common.pop("intermediate_size"), common.pop("num_attention_heads"), common.pop("hidden_size")
    return T.BartModel(T.BartConfig(**common, d_model=32, encoder_layers=3, decoder_layers=3, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
                                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                    encoder_layerdrop=0.0, decoder_layerdrop=0.0))


def _hf_layers(model):
    base = getattr(model, "model", None) or getattr(model, "bert", None) or model
    if hasattr(base, "layers"):
        return list(base.layers)
    if hasattr(base, "encoder") and hasattr(base.encoder, "layer"):
        return list(base.encoder.layer)
    return [*base.encoder.layers, *base.decoder.layers]


def _hf_forward(kind: str):
    def forward(model, batch):
        if kind == "decoder":
            return model(input_ids=batch["input_ids"]).logits
        if kind == "encoder":
            return model(input_ids=batch["input_ids"]).last_hidden_state
        out = model(input_ids=batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"])
        return torch.cat([out.encoder_last_hidden_state, out.last_hidden_state], dim=1)
    return forward


def _hf_checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _timm(name: str, **kwargs):
    import timm
    import pid_plugins.timm  # noqa: F401

    return timm.create_model(name, **kwargs)


FAN_TINY = dict(img_size=64, embed_dim=48, depth=3, num_heads=4, num_classes=10)


def _mmseg_backbone(with_cp: bool = False, **method):
    import pid_plugins.mmseg  # noqa: F401  (before mmseg.models: it installs the mmcv._ext stand-in)
    from mmseg.registry import MODELS

    return MODELS.build(dict(type="PIDVisionTransformer", img_size=(64, 64), patch_size=16, embed_dims=48,
                             num_layers=3, num_heads=3, with_cls_token=True, final_norm=True, drop_path_rate=0.0,
                             norm_cfg=dict(type="LN", eps=1e-6), with_cp=with_cp, **method))


MMSEG_HEAD = dict(in_channels=48, channels=48, num_classes=5, num_layers=3, num_heads=3, embed_dims=48,
                  dropout_ratio=0.0, drop_path_rate=0.0, norm_cfg=dict(type="LN"))


def _mmseg_head(with_cp: bool = False, **method):
    """Segmenter's mask-transformer head with a method in its 3 layers (mmseg's head has no with_cp argument: its
    layers' own flag)."""
    import pid_plugins.mmseg  # noqa: F401
    from mmseg.registry import MODELS

    head = MODELS.build(dict(type="PIDSegmenterMaskTransformerHead", **MMSEG_HEAD, **method))
    for layer in head.layers:
        layer.with_cp = with_cp
    return head


def _fairseq_lm(workdir, method=None, params=None):
    from fairseq import options, tasks
    from fairseq.data import Dictionary

    from pid_plugins.fairseq import USER_DIR

    d = Dictionary()
    for i in range(40):
        d.add_symbol(f"w{i}")
    d.save(str(workdir / "dict.txt"))
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(workdir), "--task", "language_modeling", "--arch", "transformer_lm_pid", "--user-dir", USER_DIR,
        "--decoder-layers", "3", "--decoder-embed-dim", "32", "--decoder-attention-heads", "4",
        "--decoder-ffn-embed-dim", "64", "--tokens-per-sample", "32", "--dropout", "0",
        *(["--attention-method", method, "--attention-cfg", json.dumps(params or {})] if method else [])])
    return tasks.setup_task(args).build_model(args)


def _images(size: int):
    return lambda: {"x": torch.randn(FSDP_GLOBAL_BATCH, 3, size, size, generator=torch.Generator().manual_seed(7))}


def _tokens(decoder_inputs: bool = False, low: int = 3, high: int = 96):
    def batch():
        g = torch.Generator().manual_seed(8)
        out = {"input_ids": torch.randint(low, high, (FSDP_GLOBAL_BATCH, 12), generator=g)}
        if decoder_inputs:
            out["decoder_input_ids"] = torch.randint(low, high, (FSDP_GLOBAL_BATCH, 7), generator=g)
        return out
    return batch


def _mmseg_out(model, batch):
    return torch.cat([f.flatten(1) for f in model(batch["x"])], dim=1)


def _method(name: str):
    """``(method name, parameters, zoo case)`` of a ``<method>:<case>`` name, else ``(None, None, name)``."""
    if ":" not in name:
        return None, None, name
    method, base = name.split(":", 1)
    causal = method_table().CAUSAL_METHODS.get(method) if base == "hf_decoder" else None
    if causal is not None:  # a causal model: the method's causal parameters (Elliptical's prefix mean)
        return method, causal, base
    if method == "scaled_reference":
        toy_method()
        return method, {"gamma": TOY_GAMMA}, base
    if method.endswith(LEARNABLE):  # the method with per-layer trainable parameters (PID's gains, value residual's
        return method[:-len(LEARNABLE)], {"learnable": True}, base  # lambda_1, lambda_2)
    return method, None, base


def fsdp_case(name: str, workdir):
    """(build(checkpointing) -> model, layers(model), batch() -> dict, forward(model, batch) -> tensor, checkpointing
    supported)."""
    method, params, base = _method(name)
    chosen = dict(attention=method, attention_cfg=params) if method else {}
    if base.startswith("hf_"):
        kind = base[3:]

        def build(checkpointing):
            model = _hf(kind, (method, params or {}) if method else None)
            if checkpointing:
                _hf_checkpointing(model)
            return model
        return build, _hf_layers, _tokens(kind == "encoder_decoder"), _hf_forward(kind), True
    if base in ("timm_deit", "timm_fan"):
        timm_name, kw, size = (("pid_deit_tiny_patch16_224", dict(TIMM_TINY, attention_cfg=dict(learnable=True)), 32)
                               if base == "timm_deit" else ("pid_fan_tiny_12_p16_224", FAN_TINY, 64))
        if method:
            kw = dict({k: v for k, v in kw.items() if k != "pid"}, **chosen)

        def build(checkpointing):
            model = _timm(timm_name, **kw)
            model.set_grad_checkpointing(checkpointing)
            return model
        return build, lambda m: list(m.blocks), _images(size), lambda m, b: m(b["x"]), True
    if base == "mmseg":
        return (lambda checkpointing: _mmseg_backbone(checkpointing, **chosen), lambda m: list(m.layers),
                _images(64), _mmseg_out, True)
    if base == "mmseg_head":
        def features():
            return {"x": torch.randn(FSDP_GLOBAL_BATCH, 48, 8, 8, generator=torch.Generator().manual_seed(9))}
        return (lambda checkpointing: _mmseg_head(checkpointing, **chosen), lambda m: list(m.layers), features,
                lambda m, b: m([b["x"]]), True)
    if base == "fairseq":
        return (lambda checkpointing: _fairseq_lm(workdir, method, params),
                lambda m: list(m.decoder.layers), _tokens(low=4, high=44), lambda m, b: m(b["input_ids"])[0], False)
    raise KeyError(name)


#: PID in every zoo and family kind, the toy in every zoo, the siblings where they apply (a causal grouped-query
#: Llama included), value residual with fixed and learnable lambdas (every method in every zoo: the contract)
FSDP_CASES = ("hf_decoder", "hf_encoder", "hf_encoder_decoder", "timm_deit", "timm_fan", "mmseg", "fairseq",
              *(f"scaled_reference:{c}" for c in ("hf_decoder", "timm_deit", "mmseg", "fairseq")),
              *(f"neutreno:{c}" for c in ("hf_decoder", "timm_deit", "mmseg", "fairseq")),
              *(f"elliptical:{c}" for c in ("hf_encoder", "timm_deit", "mmseg")),
              *(f"twicing:{c}" for c in ("hf_encoder", "hf_decoder", "timm_deit", "mmseg", "fairseq")),
              *(f"{m}:{c}" for m in ("elliptical", "value_residual") for c in ("hf_decoder", "fairseq")),
              *(f"value_residual:{c}" for c in ("timm_deit", "mmseg")), "value_residual_learnable:timm_deit")


#: learnable parameters in mmseg's backbone and head (issue 34), each layer's sharded with it
MMSEG_LEARNABLE_CASES = tuple(f"{m}{LEARNABLE}:{c}" for m in learnable_methods() for c in ("mmseg", "mmseg_head"))


def case_modes(name: str, workdir) -> list:
    """The modes a case runs in: PID's cases under FSDP2 both ways and with checkpointing (where the zoo supports
    it; their DDP runs are the zoos' own launchers, in test_distributed.py); the toy method's under FSDP2 (with and
    without checkpointing) and DDP, and so value residual's; PID's other siblings' under DDP."""
    supports_checkpointing = fsdp_case(name, workdir)[4]
    modes = [m for m, (_, ckpt) in FSDP_MODES.items() if m != "ddp" and (supports_checkpointing or not ckpt)]
    if name.startswith("pid_learnable:"):
        return modes + ["ddp"]
    if name.startswith(("scaled_reference:", "value_residual")):
        return [m for m in modes if m != "keep_unsharded"] + ["ddp"]
    if ":" in name:
        return ["ddp"]
    return modes


def rank_slice(batch: dict, rank: int, world: int) -> dict:
    n = FSDP_GLOBAL_BATCH // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def build_fsdp_case(name: str, workdir, checkpointing: bool = False, seed: int = 0):
    build, layers, batch, forward, supports_checkpointing = fsdp_case(name, workdir)
    torch.manual_seed(seed)
    model = build(checkpointing)
    model.train()
    return model, layers, batch, forward


def fsdp_loss(out):
    return out.float().square().mean()


# A 4-layer grouped-query Llama in 2 stages: layers 0-1's state must reach layers 2-3.
PIPELINE_METHODS = {
    **{name: (name, cfg or {}) for name, cfg in method_table().CAUSAL_METHODS.items() if name != "sdpa"},
    "pid_learnable": ("pid", {"learnable": True}),
}
#: transformers' own pipeline parallelism (hf_pp.py): every pipeline case, and Twicing starting in the second stage
PP_CASES = {**PIPELINE_METHODS, "twicing_from_2": ("twicing", {"from_layer": 2})}
PIPELINE_BATCH = 4  # rows, split into PIPELINE_MICROBATCHES microbatches by the schedule
PIPELINE_MICROBATCHES = 2
PIPELINE_STEPS = 2
PIPELINE_LR = 0.5  # plain SGD


def pipeline_config(name: str = "sdpa", params=None):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                       attention_dropout=0.0, tie_word_embeddings=False, attn_implementation=name,
                       **({name: params} if params is not None else {}))


def pipeline_llama(case: str, seed: int = 0):
    """The case's Llama (``PIPELINE_METHODS``), seeded: every rank and the one-process reference build the same."""
    import pid_plugins.hf  # noqa: F401  (registers the methods with transformers)
    from transformers import LlamaForCausalLM

    name, params = PIPELINE_METHODS[case]
    torch.manual_seed(seed)
    return LlamaForCausalLM(pipeline_config(name, params))


def pipeline_batch(step: int = 0):
    """``(input_ids, attention_mask)`` of one global batch: the inference batch (step -1) has left padding in its
    last row."""
    ids = torch.randint(3, 96, (PIPELINE_BATCH, 10), generator=torch.Generator().manual_seed(20 + step))
    mask = torch.ones_like(ids)
    if step < 0:
        ids[-1, :3], mask[-1, :3] = 0, 0
    return ids, mask


def pipeline_loss(logits, labels):
    """Next-token cross-entropy, the mean over the (micro)batch's tokens."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


#: case: (attn_implementation, parameters, the checkpoint it loads: "same" this case's, "softmax" a stock one whose
#: missing learnable parameters transformers initialises); every learnable method, and PID with fixed gains
TP_CASES = {
    **{f"{m}{LEARNABLE}": (m, {"learnable": True}, "same") for m in learnable_methods()},
    "pid": ("pid", {}, "same"),
}
FSDP_LEARNABLE_CASES = {f"{m}{LEARNABLE}": (m, {"learnable": True}, "softmax") for m in learnable_methods()}
DC_STEPS = {"tp": 2, "fsdp": 1}
DC_BATCH = 4  # rows: tensor parallelism gives every rank all of them, FSDP2 half each
DC_LR = 0.5  # plain SGD


def dc_config(name: str = "sdpa", params=None):
    """The tiny Llama of the DistributedConfig runs: 4 layers, 4 query / 2 key-value heads, hidden 64."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                       attention_dropout=0.0, tie_word_embeddings=False, initializer_range=0.1,
                       attn_implementation=name, **({name: params} if params is not None else {}))


def dc_checkpoint(case: tuple, path, seed: int = 0) -> None:
    """Save the checkpoint ``case`` loads (see ``TP_CASES``) to ``path``; the learnable parameters of a "same"
    checkpoint are moved off their initial values, so that loading them is seen."""
    import pid_plugins.hf  # noqa: F401  (registers the methods with transformers)
    from transformers import LlamaForCausalLM

    name, params, source = case
    torch.manual_seed(seed)
    model = LlamaForCausalLM(dc_config() if source == "softmax" else dc_config(name, params))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".attention_params." in n:
                p.add_(0.05 * (1 + int(n.split(".")[2])))
    model.save_pretrained(path)


def dc_load(case: tuple, path, distributed_config=None):
    """The case's model loaded from ``path``, with transformers' ``distributed_config`` (None: one process)."""
    import pid_plugins.hf  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    name, params, _ = case
    extra = {"distributed_config": distributed_config} if distributed_config is not None else {}
    config = AutoConfig.from_pretrained(path)
    if params:  # the method's parameters: config.<method>, over what the checkpoint saved
        setattr(config, name, {**(getattr(config, name, None) or {}), **params})
    return AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation=name, dtype=torch.float32,
                                                **extra)


def dc_batch(step: int):
    return torch.randint(3, 128, (DC_BATCH, 12), generator=torch.Generator().manual_seed(40 + step))


def dc_train(model, steps: int, rows=slice(None)) -> list:
    """``steps`` SGD steps on ``rows`` of each global batch; the losses."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=DC_LR)
    losses = []
    for step in range(steps):
        ids = dc_batch(step)[rows]
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def deepspeed_config(stage: int) -> dict:
    """A DeepSpeed config for the Trainer on CPU ranks: ZeRO ``stage``, float32, the Trainer's torch optimizer (no
    DeepSpeed op compiled: ``zero_allow_untested_optimizer``), no clipping."""
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": HF_PER_RANK,
            "gradient_accumulation_steps": 1, "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False}, "fp16": {"enabled": False}, "steps_per_print": 10 ** 9}


def deepspeed_cases() -> dict:
    """case: (attn_implementation, parameters, "same") for the DistributedConfig Llama (:func:`dc_config`): every method
    of tests/method_cases.py with its parameters on hf-llama (the toy registered as a user registers it), and each
    built-in method with learnable parameters, learnable."""
    table = method_table()
    llama = table.MODELS["hf-llama"]
    out = {}
    for method in table.METHODS.values():
        if llama.name in method.models:
            method.impl  # noqa: B018  (registers the toy in this process)
            params = table.method_cfg(method, llama) or {}
            out[method.name] = (method.name, dict(params), "same")
            if method.builtin and method.learnable:
                out[f"{method.name}{LEARNABLE}"] = (method.name, {**params, "learnable": True}, "same")
    return out
