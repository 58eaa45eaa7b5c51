"""Learnable method parameters out of weight decay in fairseq (issue 34)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fairseq")
import pid_plugins.fairseq as pf  # noqa: E402
from method_cases import BUILTIN  # noqa: E402
from zoo_cases import data_dir, fs_build, fs_method, fs_parse, fs_tiny  # noqa: E402,F401

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[3]
WD, LR = 0.1, 0.01
LEARNABLE = {name: fs_method(name, {"learnable": True}) for name, method in BUILTIN.items() if method.learnable}


def composite(cfg, optimizer: str, gains_weight_decay: float = 0.0):
    """``cfg`` (fairseq's, from ``--optimizer OPTIMIZER --weight-decay WD``) with ``--optimizer composite``."""
    from omegaconf import OmegaConf

    extra = {"momentum": 0.0} if optimizer == "sgd" else {}

    def group(weight_decay):
        return {"lr": [LR], "optimizer": {"_name": optimizer, "weight_decay": weight_decay, **extra},
                "lr_scheduler": {"_name": "fixed"}}

    cfg.optimizer = OmegaConf.create({"_name": "composite", "groups": {
        "default": group(WD), pf.METHOD_PARAM_GROUP: group(gains_weight_decay)}})
    cfg.lr_scheduler = OmegaConf.create({"_name": "pass_through"})
    return cfg


def fairseq_trainer(data_dir, method: str, optimizer: str, grouped: bool = True):
    """fairseq's ``Trainer`` as ``fairseq_cli.train`` builds it (task, model, criterion, cfg), CPU."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer
    from fairseq import tasks

    args = fs_parse(data_dir, extra=[*LEARNABLE[method], "--optimizer", optimizer, "--weight-decay", str(WD),
                                     "--lr", str(LR), "--cpu"])
    cfg = convert_namespace_to_omegaconf(args)
    if grouped:
        cfg = composite(cfg, optimizer)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    return Trainer(cfg, task, model, task.build_criterion(cfg.criterion)), model


def gains_of(model):
    return {name: p for name, p in model.named_parameters() if ".attention_params." in name}


@pytest.mark.parametrize("method", LEARNABLE)
def test_learnable_parameters_are_in_fairseqs_param_group(data_dir, method):
    model, _, _ = fs_build(data_dir, extra=LEARNABLE[method])
    gains = gains_of(model)
    assert len(gains) >= 2 * len(model.decoder.layers) - 2
    assert all(getattr(p, "param_group", None) == "attention_params" for p in gains.values())
    assert not any(hasattr(p, "param_group") for n, p in model.named_parameters() if n not in gains)
    model.to(torch.float64)  # a dtype conversion keeps the tag (also where it makes new Parameter objects)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(torch.float32)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert all(getattr(p, "param_group", None) == "attention_params" for p in gains_of(model).values())
    assert set(gains_of(model)) == set(gains)


@pytest.mark.parametrize("method, optimizer", [(name, "adam") for name in LEARNABLE] + [("pid", "sgd"), ("pid", "nag")])
def test_fairseqs_trainer_builds_a_group_without_weight_decay_for_the_learnable_parameters(data_dir, method,
                                                                                         optimizer):
    trainer, model = fairseq_trainer(data_dir, method, optimizer)
    groups = list(trainer.optimizer.param_groups)  # built by fairseq (Trainer._build_optimizer)
    gains = {id(p) for p in gains_of(model).values()}
    undecayed = [id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]]
    decayed = [id(p) for g in groups if g["weight_decay"] == WD for p in g["params"]]
    assert len(groups) == 2 and sorted(undecayed) == sorted(gains)
    assert sorted(decayed) == sorted({id(p) for p in model.parameters()} - gains)  # everything else, once
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    for name, p in model.named_parameters():
        if ".attention_params." in name:
            assert torch.equal(p, before[name]), name
        else:
            torch.testing.assert_close(p, before[name] * (1 - LR * WD), rtol=1e-6, atol=0)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if ".attention_params." not in n)


def test_without_the_composite_optimizer_fairseq_decays_the_gains(data_dir):
    """What the group changes."""
    trainer, model = fairseq_trainer(data_dir, "pid", "adam", grouped=False)
    groups = list(trainer.optimizer.param_groups)
    assert len(groups) == 1 and groups[0]["weight_decay"] == WD
    before = {name: p.detach().clone() for name, p in gains_of(model).items()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    for name, p in gains_of(model).items():
        torch.testing.assert_close(p, before[name] * (1 - LR * WD), rtol=1e-6, atol=0)
        assert not torch.equal(p, before[name])


YAML = """\
common: {{cpu: true, user_dir: {user_dir}, log_interval: 1, seed: 1}}
task: {{_name: language_modeling, data: {data}, tokens_per_sample: 32}}
model:
  _name: transformer_lm_pid
  attention_cfg: '{{"learnable": true}}'
  decoder_layers: 3
  decoder_embed_dim: 32
  decoder_ffn_embed_dim: 64
  decoder_attention_heads: 4
  dropout: 0.0
criterion: cross_entropy
optimizer:
  _name: composite
  groups:
    default:
      lr: [0.001]
      optimizer: {{_name: adam, weight_decay: 0.1}}
      lr_scheduler: {{_name: fixed}}
    attention_params:
      lr: [0.001]
      optimizer: {{_name: adam, weight_decay: 0.0}}
      lr_scheduler: {{_name: fixed}}
lr_scheduler: pass_through
optimization: {{max_update: 2, lr: [0.001]}}
dataset: {{max_tokens: 128, num_workers: 0}}
checkpoint: {{save_dir: {save_dir}, no_epoch_checkpoints: true}}
"""


@pytest.mark.integration  # fairseq-hydra-train's CLI
@pytest.mark.slow
def test_fairseq_hydra_train_with_a_gains_group(tmp_path, data_dir, tiny_fairseq_data_bin):
    """The real CLI."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               HYDRA_FULL_ERROR="1")

    def run(cmd):
        proc = subprocess.run([str(BIN / cmd[0]), *map(str, cmd[1:])], cwd=tmp_path, capture_output=True, text=True,
                              timeout=900, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "gains.yaml").write_text(YAML.format(user_dir=pf.USER_DIR, data=tiny_fairseq_data_bin,
                                                              save_dir=tmp_path / "ck"))
    log = run(["fairseq-hydra-train", "--config-dir", tmp_path / "conf", "--config-name", "gains"])
    assert "lr_attention_params=0.001" in log and "model: PIDTransformerLanguageModel" in log
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    gains = [k for k in state["model"] if ".attention_params." in k]
    assert len(gains) == 9  # 3 layers x (lambda_p, lambda_i, lambda_d)
    optim = state["last_optimizer_state"]
    assert set(optim) == {"default", "attention_params"}
    assert [(g["weight_decay"], len(g["params"])) for g in optim["attention_params"]["param_groups"]] == [(0.0, 9)]
    same, _, _ = fs_build(data_dir, extra=LEARNABLE["pid"])  # the same architecture: its other parameters
    others = sum(1 for n, _ in same.named_parameters() if ".attention_params." not in n)
    assert [(g["weight_decay"], len(g["params"])) for g in optim["default"]["param_groups"]] == [(0.1, others)]
    log = run(["fairseq-hydra-train", "--config-dir", tmp_path / "conf", "--config-name", "gains",
               "optimization.max_update=3"])
    assert "Loaded checkpoint" in log and "num_updates=3" in log
