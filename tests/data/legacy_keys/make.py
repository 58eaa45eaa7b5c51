"""Writes the tiny checkpoints in this folder with the attribute names of releases before the rename
(``pid_gains``, the learnable per-layer parameters; ``pid_warmup``, the gain warm-up counter), one set per zoo in
the format that zoo saves. tests/test_legacy_keys.py loads them with the current code and checks every saved value
arrives unchanged under the new names (``attention_params``, ``attention_warmup``).

Run once, at commit 6f7d99207d0c9fe7ec3d85bbc3f49b1cf1f557d1 (the last commit before the rename; the writing part
needs the old names and does not run on later commits)::

    PYTHONPATH=. python tests/data/legacy_keys/make.py

The builders (``timm_kwargs``, ``hf_config``, ``mmseg_segmentor``, ``fairseq_args``) are shared with the test, so
it rebuilds exactly the models that were saved. Every model is tiny (a few KB to ~100 KB per file); the learnable
parameters hold non-initial values, and each warm-up counter a step > 0.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

import torch

HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------------------- the models saved
#: PID with learnable gains and gain warm-up (both renamed attributes in one model); the counter is saved at STEP
PID_CFG = {"learnable": True, "warmup_steps": 6}
STEP = 4
#: value residual's learnable lambdas (no warm-up: value residual is not additive)
VR_CFG = {"learnable": True, "lambda_1": 0.3, "lambda_2": 0.6}

#: timm: (file, model name, attention, attention_cfg, tiny arguments)
TIMM_DEIT = dict(img_size=16, patch_size=8, embed_dim=24, depth=2, num_heads=2, num_classes=10)
TIMM_FAN = dict(img_size=32, embed_dim=24, depth=1, num_heads=2, num_classes=10)
TIMM_CASES = [
    ("timm_deit_pid.pth", "pid_deit_tiny_patch16_224", "pid", PID_CFG, TIMM_DEIT),
    ("timm_deit_value_residual.safetensors", "pid_deit_tiny_patch16_224", "value_residual", VR_CFG, TIMM_DEIT),
    ("timm_fan_pid.pth", "pid_fan_tiny_12_p16_224", "pid", PID_CFG, TIMM_FAN),
]
#: transformers: (directory, attn_implementation, the method's parameters)
HF_CASES = [("hf_llama_pid", "pid", PID_CFG), ("hf_llama_value_residual", "value_residual", VR_CFG)]
#: mmseg: a whole segmentor (backbone: PID learnable + warm-up; head: value residual learnable) and its backbone alone
MMSEG_SEGMENTOR = "mmseg_segmentor.pth"
MMSEG_BACKBONE = "mmseg_backbone.pth"
#: fairseq: (file, method, its parameters)
FAIRSEQ_CASES = [("fairseq_pid.pt", "pid", PID_CFG), ("fairseq_value_residual.pt", "value_residual", VR_CFG)]


def hf_config(method: str, params: Dict[str, Any]):
    """A tiny Llama config running ``method`` with ``params``."""
    import transformers as T

    return T.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0,
                         attn_implementation=method, **{method: params})


def mmseg_model_cfg() -> Dict[str, Any]:
    """The tiny segmentor's model config (mmseg's EncoderDecoder over the PID backbone and mask-transformer head)."""
    return dict(
        type="EncoderDecoder",
        data_preprocessor=dict(type="SegDataPreProcessor", mean=[127.5] * 3, std=[127.5] * 3, bgr_to_rgb=True,
                               pad_val=0, seg_pad_val=255, size=(16, 16)),
        backbone=dict(type="PIDVisionTransformer", img_size=(16, 16), patch_size=8, in_channels=3, embed_dims=24,
                      num_layers=2, num_heads=2, mlp_ratio=2, drop_path_rate=0.0, final_norm=True,
                      with_cls_token=True, norm_cfg=dict(type="LN", eps=1e-6), attention="pid", attention_cfg=PID_CFG),
        decode_head=dict(type="PIDSegmenterMaskTransformerHead", in_channels=24, channels=24, num_classes=3,
                         num_layers=2, num_heads=2, embed_dims=24, dropout_ratio=0.0, drop_path_rate=0.0,
                         norm_cfg=dict(type="LN"), attention="value_residual", attention_cfg=VR_CFG,
                         loss_decode=dict(type="CrossEntropyLoss", use_sigmoid=False, loss_weight=1.0)),
        test_cfg=dict(mode="whole"),
    )


def mmseg_segmentor(seed: int = 0, **backbone: Any):
    """The tiny segmentor built through mmseg's registry (``backbone``: overrides of the backbone's config)."""
    import pid_plugins.mmseg  # noqa: F401  (registers the PID types)
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    init_default_scope("mmseg")
    cfg = mmseg_model_cfg()
    cfg["backbone"].update(backbone)
    torch.manual_seed(seed)
    model = MODELS.build(cfg)
    model.init_weights()
    return model


def fairseq_args(data: Path, method: str, params: Dict[str, Any]) -> List[str]:
    """fairseq's training arguments for a tiny ``transformer_lm_pid`` running ``method`` with ``params``."""
    import pid_plugins.fairseq as pf

    return [str(data), "--task", "language_modeling", "--arch", "transformer_lm_pid", "--user-dir", pf.USER_DIR,
            "--decoder-layers", "2", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
            "--decoder-attention-heads", "2", "--decoder-input-dim", "16", "--decoder-output-dim", "16",
            "--tokens-per-sample", "16", "--dropout", "0",
            "--attention-method", method, "--attention-cfg", json.dumps(params)]


def fairseq_dictionary(directory: Path) -> None:
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for i in range(12):
        dictionary.add_symbol(f"w{i}")
    dictionary.save(str(directory / "dict.txt"))


# --------------------------------------------------------------------------------------- writing (old names)
def _perturb(model: torch.nn.Module) -> None:
    """Non-initial values in every learnable method parameter (old name ``pid_gains``), a warm-up step > 0."""
    with torch.no_grad():
        for i, (name, p) in enumerate(n_p for n_p in model.named_parameters() if ".pid_gains." in n_p[0]):
            p.add_(0.125 * (i + 1))
        for name, module in model.named_modules():
            if name.endswith("pid_warmup") or name == "pid_warmup":
                module.step.fill_(STEP)


def _check(state_dict: Dict[str, torch.Tensor], warmup: bool) -> None:
    assert any(".pid_gains." in k for k in state_dict), sorted(state_dict)
    assert not warmup or any(k.endswith("pid_warmup.step") for k in state_dict), sorted(state_dict)


def write_timm() -> None:
    import timm
    from safetensors.torch import save_file

    import pid_plugins.timm  # noqa: F401

    for file, name, attention, cfg, args in TIMM_CASES:
        torch.manual_seed(0)
        model = timm.create_model(name, attention=attention, attention_cfg=cfg, **args)
        _perturb(model)
        state = model.state_dict()
        _check(state, "warmup_steps" in cfg)
        if file.endswith(".safetensors"):
            save_file({k: v.contiguous() for k, v in state.items()}, str(HERE / file))
        else:
            torch.save(state, HERE / file)


def write_hf() -> None:
    import transformers as T

    import pid_plugins.hf  # noqa: F401

    for directory, method, params in HF_CASES:
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(hf_config(method, params))
        _perturb(model)
        _check(model.state_dict(), "warmup_steps" in params)
        model.save_pretrained(HERE / directory)  # model.safetensors + config.json (+ generation_config.json)


def write_mmseg() -> None:
    model = mmseg_segmentor()
    _perturb(model)
    state = model.state_dict()
    _check(state, True)
    meta = {"mmengine_version": "0.10.7", "written_by": "tests/data/legacy_keys/make.py", "iter": STEP}
    torch.save({"meta": meta, "state_dict": state}, HERE / MMSEG_SEGMENTOR)
    backbone = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    torch.save({"meta": meta, "state_dict": backbone}, HERE / MMSEG_BACKBONE)


def write_fairseq() -> None:
    from fairseq import options, tasks

    import pid_plugins.fairseq  # noqa: F401

    fairseq_dictionary(HERE)
    for file, method, params in FAIRSEQ_CASES:
        args = options.parse_args_and_arch(options.get_training_parser(), fairseq_args(HERE, method, params))
        task = tasks.setup_task(args)
        torch.manual_seed(0)
        model = task.build_model(args)
        _perturb(model)
        _check(model.state_dict(), "warmup_steps" in params)
        _save_fairseq(model, args, str(HERE / file))


def _save_fairseq(model, args, path: str) -> None:
    """A checkpoint as fairseq-train writes it (cfg, model, optimizer history), through checkpoint_utils."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)
    cfg["task"]["data"] = "."  # the folder's own dict.txt; loaders pass the data directory
    checkpoint_utils.torch_persistent_save({
        "cfg": cfg, "args": None, "model": model.state_dict(),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                               "lr_scheduler_state": {}, "num_updates": STEP}],
        "extra_state": {"train_iterator": {"epoch": 1}}, "last_optimizer_state": None,
    }, path)


if __name__ == "__main__":
    os.chdir(HERE)
    write_timm()
    write_hf()
    write_mmseg()
    write_fairseq()
    for path in sorted(HERE.rglob("*")):
        if path.is_file() and path.name != "make.py":
            print(f"{path.stat().st_size:>8}  {path.relative_to(HERE)}")
