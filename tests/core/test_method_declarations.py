"""Methods declare, adapters read declarations (state per head, default preset per zoo): a user's method runs in timm,
transformers and vLLM's tensor-parallel check by its declarations alone, and no built-in method's name decides anything
in the adapters or the catalogue."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pid_plugins
import toy_method
from method_cases import BUILTIN
from pid_plugins.catalogue import ModelEntry, parse_catalogue
from pid_plugins.core import FX_LEAVES
from pid_plugins.vllm.config import TENSOR_PARALLEL, check_engine, method_choice

PACKAGE = Path(pid_plugins.__file__).resolve().parent
DECLARED = "declared_reference"
UNDECLARED = "undeclared_reference"


class DeclaredReference(toy_method.ScaledReference):
    """The toy rule (``A v + gamma v^1``), declaring its state per head and a stronger timm preset."""

    name = DECLARED
    per_head_state = True  # v^1 (B, H_kv, N, D), one gamma for every head
    default_presets = {"timm": "strong", "*": "default"}


class UndeclaredReference(toy_method.ScaledReference):
    """The same rule, declaring nothing beyond the contract's required attributes (per_head_state: False)."""

    name = UNDECLARED


pid_plugins.register_method(DeclaredReference(), replace=True)
pid_plugins.register_method(UndeclaredReference(), replace=True)
CONFIG = toy_method.ScaledReferenceConfig


def test_the_catalogue_holds_a_users_methods_parameters():
    bare = ModelEntry(name="declared_deit", zoo="timm", base="deit_tiny_patch16_224", arch="vit", method=DECLARED)
    assert bare.default_config() == CONFIG(gamma=2.0)  # its declared timm preset
    assert dataclasses.replace(bare, zoo="hf").default_config() == CONFIG(gamma=0.5)  # its "*" preset
    entry = dataclasses.replace(bare, preset="default", gains={"gamma": 0.7})
    assert entry.default_config() == CONFIG(gamma=0.7) and entry.configure({"gamma": 0.1}) == CONFIG(gamma=0.1)
    toml = f'[[model]]\nname = "declared_deit"\nbase = "deit_tiny_patch16_224"\nmethod = "{DECLARED}"\n'
    assert parse_catalogue([("timm.toml", toml)])["declared_deit"].default_config() == CONFIG(gamma=2.0)
    with pytest.raises(ValueError, match=f"model 'declared_deit' \\(attention method '{DECLARED}'\\): unknown "
                                         "ScaledReferenceConfig field"):
        parse_catalogue([("timm.toml", toml + "gains = { beta = 0.3 }\n")])


def test_vllm_serves_a_method_with_tensor_parallelism_by_its_declaration():
    """vLLM's check (pid_plugins.vllm.config, no vLLM needed): a method declaring per_head_state is served with
    tensor_parallel_size=2, the same rule without the declaration is refused, naming the declaration."""
    engine = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=2),
                             speculative_config=None)
    for name, served in ((DECLARED, True), (UNDECLARED, False)):
        choice = method_choice(SimpleNamespace(_attn_implementation=name, **{name: {"gamma": 0.3}}), "ckpt")
        assert choice.method is pid_plugins.get_method(name) and choice.config == CONFIG(gamma=0.3)
        assert (name in TENSOR_PARALLEL) is served
        if served:
            check_engine(engine, "ckpt", tensor_parallel=name in TENSOR_PARALLEL)
        else:
            with pytest.raises(ValueError, match="tensor_parallel_size=2 \\(served only for methods that declare "
                                                 "per_head_state: ") as info:
                check_engine(engine, "ckpt", tensor_parallel=name in TENSOR_PARALLEL)
            assert DECLARED in str(info.value) and UNDECLARED not in str(info.value)
    assert {"pid", "neutreno", "value_residual"} <= set(TENSOR_PARALLEL)  # the built-ins declaring it, served
    assert not {"twicing", "elliptical"} & set(TENSOR_PARALLEL)  # (they declare no per_head_state)
    assert "not a method" not in TENSOR_PARALLEL and None not in TENSOR_PARALLEL


def test_timm_runs_a_users_method_by_its_declarations():
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401
    from pid_plugins.timm._helpers import entry_choice
    from timm.layers import is_notrace_function

    assert all(is_notrace_function(leaf) for leaf in FX_LEAVES)  # core's public fx leaves, in timm's list
    kw = dict(img_size=32, patch_size=8, depth=3, num_classes=10, embed_dim=32, num_heads=2)
    declared = timm.create_model("pid_deit_tiny_patch16_224", attention=DECLARED, **kw).eval()
    assert {b.attn.attention_config for b in declared.blocks} == {CONFIG(gamma=2.0)}  # not the entry's PID gains
    same = timm.create_model("pid_deit_tiny_patch16_224", attention=toy_method.NAME, attention_cfg="strong",
                             **kw).eval()
    stock = timm.create_model("deit_tiny_patch16_224", **kw).eval()
    for model in (declared, same):
        model.load_state_dict(stock.state_dict())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(declared(x), same(x)) and not torch.allclose(declared(x), stock(x))
    entry = ModelEntry(name="declared_deit", zoo="timm", base="deit_tiny_patch16_224", arch="vit", method=DECLARED,
                       preset="default", gains={"gamma": 0.7})
    assert entry_choice(entry, DECLARED, {}, "declared_deit").config == CONFIG(gamma=0.7)  # the entry's parameters
    assert entry_choice(entry, DECLARED, {"attention": "pid"}, "declared_deit").config == \
        pid_plugins.get_method("pid").configure(None, "timm")  # another method: its own timm preset


def test_transformers_runs_a_users_method_by_its_declarations(monkeypatch):
    pytest.importorskip("transformers")
    import pid_plugins.hf as ph
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from zoo_cases import hf_ids, llama_config

    torch.manual_seed(0)
    declared = LlamaForCausalLM(llama_config(DECLARED)).eval()  # no parameters: its declared default
    assert ph.model_method_config(declared.config) == CONFIG(gamma=0.5)
    same = LlamaForCausalLM(llama_config(toy_method.NAME, {"gamma": 0.5})).eval()
    same.load_state_dict({k: v for k, v in declared.state_dict().items() if "pid_plugins" not in k}, strict=False)
    with torch.no_grad():
        assert torch.equal(declared(hf_ids()).logits, same(hf_ids()).logits)
    # a catalogue entry of the user's method: its config names the method and holds the entry's parameters
    entry = ModelEntry(name="declared_llama", zoo="hf", base="llama", arch="causal_lm", method=DECLARED,
                       gains={"gamma": 0.25}, kwargs=dict(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2))
    monkeypatch.setattr(pid_plugins.catalogue, "load_catalogue", lambda: {entry.name: entry})
    config = ph.get_config("declared_llama")
    assert config._attn_implementation == DECLARED and getattr(config, DECLARED) == {"gamma": 0.25}
    model = AutoModelForCausalLM.from_config(config).eval()
    assert ph.model_method_config(model.config) == CONFIG(gamma=0.25)
    assert ph.model_method_config(ph.get_config("declared_llama", {"gamma": 0.1})) == CONFIG(gamma=0.1)


def _docstrings(tree: ast.AST) -> set:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, nodes) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _names_deciding(path: Path, names: set) -> list:
    """Where ``path`` holds a method's name as a value: compared with, listed, a dict key, or (any name but the
    package's default "pid") anywhere outside a docstring."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings, found = _docstrings(tree), []
    for node in ast.walk(tree):
        operands = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, (ast.Set, ast.List, ast.Tuple)):
            operands = node.elts
        elif isinstance(node, ast.Dict):
            operands = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Constant) and node.value in names - {"pid"} and id(node) not in docstrings:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.value!r}")
        found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {type(node).__name__} with {op.value!r}"
                  for op in operands if isinstance(op, ast.Constant) and op.value in names]
    return found


def test_no_method_name_decides_anything_in_the_adapters_or_the_catalogue():
    files = [PACKAGE / "catalogue.py", *(p for zoo in ("hf", "timm", "mmseg", "fairseq", "vllm")
                                        for p in sorted((PACKAGE / zoo).rglob("*.py")))]
    assert len(files) > 30
    assert [hit for path in files for hit in _names_deciding(path, set(BUILTIN))] == []
    private = [f"{p.name}: {alias.name}" for p in files for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ImportFrom) and "core" in (node.module or "")
               for alias in node.names if alias.name.startswith("_")]
    assert private == []  # the adapters use core's public names only (timm's fx leaves: core.FX_LEAVES)
