"""Analysis tools: the measures on inputs with known answers, the hooks against the zoos' own APIs, the
attacks on a small trained model, and the diagnose/attack commands end to end (timm, HF, mmseg)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from pid_plugins.analysis.diagnostics import (
    AttentionRecorder, collect_layer_measures, find_layer_stack, masked_row_sparsity, repeated_passes,
)
from pid_plugins.analysis.measures import (
    consensus_distance, effective_rank, mean_pairwise_cosine, numerical_rank,
)
from pid_plugins.cli import main

timm = pytest.importorskip("timm")
import pid_plugins.timm  # noqa: E402,F401

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=32, depth=3, num_heads=2)


# ----------------------------------------------------------------------------------- measures, known answers
def test_identical_tokens_are_fully_collapsed():
    tokens = torch.randn(1, 16).expand(5, 16).unsqueeze(0)
    assert mean_pairwise_cosine(tokens).item() == pytest.approx(1.0, abs=1e-6)
    assert consensus_distance(tokens).item() == pytest.approx(0.0, abs=1e-6)
    assert numerical_rank(tokens).item() == 1
    assert effective_rank(tokens).item() == pytest.approx(1.0, abs=1e-4)


def test_orthogonal_tokens_are_not_collapsed():
    tokens = torch.eye(6)[None] * 3.0
    assert mean_pairwise_cosine(tokens).item() == pytest.approx(0.0, abs=1e-7)
    assert numerical_rank(tokens).item() == 6
    assert effective_rank(tokens).item() == pytest.approx(6.0, rel=1e-6)
    # E: token 1 is aligned with itself only -> 1 - 1/N
    assert consensus_distance(tokens).item() == pytest.approx(1 - 1 / 6)


def test_sparsity_is_minimal_for_one_hot_rows_and_one_for_uniform_rows():
    n = 9
    one_hot = torch.eye(n)[None]
    uniform = torch.full((1, n, n), 1.0 / n)
    assert masked_row_sparsity(one_hot).flatten() == pytest.approx([1 / math.sqrt(n)] * n)
    assert masked_row_sparsity(uniform).flatten() == pytest.approx([1.0] * n)
    # causal rows: only the allowed entries count, so a uniform causal row is 1 at every length
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    causal_uniform = allowed.float() / allowed.sum(-1, keepdim=True)
    assert masked_row_sparsity(causal_uniform, allowed).tolist() == pytest.approx([1.0] * n)


# ----------------------------------------------------------------------------------- hooks vs the zoo's APIs
@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "pid_deit_tiny_patch16_224"])
def test_layer_measures_match_the_blocks_outputs(name):
    torch.manual_seed(0)
    model = timm.create_model(name, **SMALL).eval()
    x = torch.rand(4, 1, 8, 8)
    res = collect_layer_measures(model, [x[:2], x[2:]])
    assert res["layer_stack"] == "blocks" and res["num_layers"] == 3
    # the hooks see the whole block output (class token included): recompute it by running the blocks
    with torch.no_grad():
        t = model.patch_embed(x)
        t = model._pos_embed(t)
        state = ()
        for i, blk in enumerate(model.blocks):
            out = blk(t, *state, with_state=True) if hasattr(blk.attn, "attention_method") else blk(t)
            t, state = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())
            assert res["mean_cosine"][i] == pytest.approx(mean_pairwise_cosine(t).mean().item(), rel=1e-5)
            assert res["consensus_distance"][i] == pytest.approx(consensus_distance(t).mean().item(), rel=1e-5)


def test_attention_recorder_matches_the_explicit_attention_path():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", **SMALL).eval()
    x = torch.rand(2, 1, 8, 8)
    fused = collect_layer_measures(model, [x])["attention_sparsity"]
    # timm's non-fused path materialises softmax(qk^T) and passes it through attn_drop: hook it there
    seen = []
    handles = []
    for blk in model.blocks:
        blk.attn.fused_attn = False
        handles.append(blk.attn.attn_drop.register_forward_hook(
            lambda m, a, out: seen.append(masked_row_sparsity(out).mean().item())))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    assert fused == pytest.approx(seen, rel=1e-4)
    assert all(1 / math.sqrt(17) - 1e-6 <= s <= 1.0 + 1e-6 for s in fused)


def test_recorder_handles_causal_grouped_query_sdpa():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8)
    rec = AttentionRecorder()
    rec.layer = 0
    with rec:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    kk = k.repeat_interleave(2, dim=1)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    probs = ((q @ kk.transpose(-1, -2)) / math.sqrt(8)).masked_fill(~allowed, float("-inf")).softmax(-1)
    expected = masked_row_sparsity(probs, allowed)
    assert expected[..., 0].eq(1.0).all()  # row 0 has one allowed entry
    assert rec.per_layer(1)[0] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert rec.per_layer(1)[0] < 1.0


def test_repeated_passes_feed_the_output_back():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", **SMALL).eval()
    x = torch.rand(2, 1, 8, 8)
    energies = repeated_passes(model, x, passes=3)
    with torch.no_grad():
        t = model._pos_embed(model.patch_embed(x))
        expected = []
        for _ in range(3):
            t = model.blocks(t)
            expected.append(consensus_distance(t).mean().item())
    assert energies == pytest.approx(expected, rel=1e-5)


def test_layer_stack_errors_are_clear():
    model = timm.create_model("deit_tiny_patch16_224", **SMALL)
    assert find_layer_stack(model, "blocks")[0] == "blocks"
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        find_layer_stack(model, "nope")
    with pytest.raises(ValueError, match="not a non-empty"):
        find_layer_stack(model, "head")


# ----------------------------------------------------------------------------------- robustness
@pytest.fixture(scope="module")
def trained_digits_model():
    """A small ViT trained for a few seconds on scikit-learn's real digits (train split)."""
    from pid_plugins.analysis.robustness import PixelClassifier
    from pid_plugins.analysis.datasets import load_images

    torch.manual_seed(0)
    train = load_images("digits", "train")
    model = timm.create_model("deit_tiny_patch16_224", **SMALL)
    clf = PixelClassifier(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for epoch in range(12):
        perm = torch.randperm(len(train))
        for i in range(0, len(train), 64):
            idx = perm[i:i + 64]
            loss = F.cross_entropy(clf(train.images[idx]), train.labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return clf.eval()


@pytest.mark.slow
def test_attacks_reduce_accuracy_and_never_increase_it(trained_digits_model):
    from pid_plugins.analysis.robustness import evaluate_image_robustness
    from pid_plugins.analysis.datasets import load_images

    test = load_images("digits", "test", limit=200)
    res = evaluate_image_robustness(
        trained_digits_model, test.images, test.labels, attacks=("fgsm", "pgd"),
        eps_sweep=[2 / 255, 8 / 255, 32 / 255], pgd_steps=10, noise_sigmas=(0.1, 0.5),
        corruptions=("gaussian_noise", "contrast"), severities=(1, 5), progress=False,
    )
    clean = res["clean"]["top1"]
    assert clean > 0.7, "the model should have learned the digits"
    assert res["clean"]["top5"] >= clean
    for name in ("fgsm", "pgd"):
        accs = res[name]["top1"]
        assert all(a <= clean for a in accs)
        assert accs[-1] < clean - 0.2, f"{name} at eps 32/255 should hurt a lot"
    assert res["pgd"]["top1"][-1] <= res["fgsm"]["top1"][-1]
    assert res["noise"]["top1"][1] < clean
    c = res["corruptions"]
    assert set(c["top1"]) == {"gaussian_noise", "contrast"} and all(len(v) == 2 for v in c["top1"].values())
    assert c["top1"]["gaussian_noise"][1] <= c["top1"]["gaussian_noise"][0] + 0.02
    assert 0.0 <= c["mean_corruption_error"] <= 1.0


@pytest.mark.slow
def test_spsa_runs_and_does_not_raise_accuracy(trained_digits_model):
    from pid_plugins.analysis.robustness import evaluate_image_robustness
    from pid_plugins.analysis.datasets import load_images

    test = load_images("digits", "test", limit=32)
    res = evaluate_image_robustness(trained_digits_model, test.images, test.labels, attacks=("spsa",),
                                    eps=16 / 255, spsa_iters=2, noise_sigmas=(), corruptions=(), progress=False)
    assert res["spsa"]["top1"][0] <= res["clean"]["top1"]
    # the attack does something: images moved within the eps ball, the loss it ascends higher (a no-op attack, which
    # the accuracy check alone would pass, fails here)
    import torchattacks

    x, y = test.images[:16], test.labels[:16]
    torch.manual_seed(0)
    adv = torchattacks.SPSA(trained_digits_model.eval(), eps=16 / 255, nb_iter=2, nb_sample=64, max_batch_size=64)(x, y)
    moved = (adv - x).abs()
    assert moved.max() > 0 and moved.max() <= 16 / 255 + 1e-6
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy
        assert loss(trained_digits_model(adv), y) > loss(trained_digits_model(x), y)


def test_corruptions_and_relative_mce():
    from pid_plugins.analysis.robustness import _corrupt, relative_mce

    x = torch.rand(3, 1, 12, 12)
    y = _corrupt(x, "gaussian_noise", 3, seed=0)
    assert y.shape == x.shape and 0 <= y.min() and y.max() <= 1 and not torch.allclose(x, y)
    r = {"corruptions": {"top1": {"a": [0.5, 0.4], "b": [0.9, 0.8]}}}
    base = {"corruptions": {"top1": {"a": [0.0, 0.0], "b": [0.7, 0.6]}}}
    assert relative_mce(r, r) == pytest.approx(100.0)
    assert relative_mce(r, base) == pytest.approx(100 * ((1.1 / 2.0) + (0.3 / 0.7)) / 2)


# ----------------------------------------------------------------------------------- HF
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llamas(tmp_path_factory):
    import pid_plugins.hf

    root = tmp_path_factory.mktemp("llamas")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(root / "softmax")
    pid_plugins.hf.convert(model, "pid")
    model.save_pretrained(root / "pid")
    return root / "softmax", root / "pid"


def test_lm_perplexity_matches_the_model_loss(tiny_llamas):
    from pid_plugins.analysis.robustness import lm_perplexity

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llamas[1])
    blocks = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(input_ids=blocks, labels=blocks).loss
    assert lm_perplexity(model, blocks, batch_size=3) == pytest.approx(math.exp(loss.item()), rel=1e-4)
    assert lm_perplexity(model, blocks, noise_rate=0.5) != pytest.approx(math.exp(loss.item()), rel=1e-4)
    with pytest.raises(ValueError, match="noise rate"):
        lm_perplexity(model, blocks, noise_rate=1.0)


def test_hf_layer_measures_use_the_hidden_states(tiny_llamas):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llamas[0])
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    res = collect_layer_measures(model, [{"input_ids": ids}])
    assert res["layer_stack"] == "model.layers" and res["num_layers"] == 3
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    # hidden_states[i + 1] is layer i's output (the last one after the final norm: cosine is scale-free per
    # token but RMSNorm's weight is 1 at init, so it matches too)
    for i in range(3):
        assert res["mean_cosine"][i] == pytest.approx(mean_pairwise_cosine(hidden[i + 1]).mean().item(), rel=1e-4)
    assert all(s is not None and s < 1.0 for s in res["attention_sparsity"])


# ----------------------------------------------------------------------------------- the commands
def _png(path):
    return path.is_file() and path.read_bytes()[:8] == PNG


@pytest.mark.slow
def test_cli_diagnose_timm_writes_json_and_png(tmp_path, capsys):
    kwargs = json.dumps(SMALL)
    rc = main(["diagnose", "--model", "deit_tiny_patch16_224", "--model", "pid_deit_tiny_patch16_224",
               "--model-kwargs", kwargs, "--data", "digits", "--num-samples", "16", "--passes", "3",
               "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "diagnose.json").read_text())
    assert set(rep["models"]) == {"deit_tiny_patch16_224", "pid_deit_tiny_patch16_224"}
    for r in rep["models"].values():
        for key in ("mean_cosine", "consensus_distance", "numerical_rank", "effective_rank", "attention_sparsity"):
            assert len(r[key]) == 3 and all(v is not None and math.isfinite(v) for v in r[key])
        assert len(r["repeated_passes"]) == 3
    assert _png(tmp_path / "diagnose.png")
    assert "pid_deit_tiny_patch16_224" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_diagnose_and_attack_hf_folders(tmp_path, tiny_llamas):
    text = tmp_path / "text.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 60)
    rc = main(["diagnose", "--model", str(tiny_llamas[0]), "--model", str(tiny_llamas[1]), "--data", str(text),
               "--num-samples", "4", "--seq-len", "32", "--passes", "2", "--out", str(tmp_path / "d")])
    assert rc == 0
    rep = json.loads((tmp_path / "d" / "diagnose.json").read_text())
    assert set(rep["models"]) == {"softmax", "pid"}
    assert _png(tmp_path / "d" / "diagnose.png")
    rc = main(["attack", "--model", str(tiny_llamas[1]), "--data", str(text), "--num-samples", "4",
               "--seq-len", "32", "--rates", "0,0.2", "--out", str(tmp_path / "a")])
    assert rc == 0
    rep = json.loads((tmp_path / "a" / "attack.json").read_text())
    r = rep["models"]["pid"]
    assert rep["kind"] == "causal_lm" and r["substitution_rate"] == [0.0, 0.2]
    assert all(math.isfinite(p) and p > 1 for p in r["perplexity"])
    assert _png(tmp_path / "a" / "attack.png")


@pytest.mark.slow
def test_cli_attack_timm_with_checkpoint_and_baseline(tmp_path, trained_digits_model):
    ckpt = tmp_path / "digits_vit.pth"
    torch.save(trained_digits_model.model.state_dict(), ckpt)
    rc = main(["attack", "--model", "deit_tiny_patch16_224", "--model", "deit_tiny_patch16_224",
               "--checkpoint", str(ckpt), "--checkpoint", str(ckpt), "--model-kwargs", json.dumps(SMALL),
               "--baseline", "deit_tiny_patch16_224", "--data", "digits", "--num-samples", "64",
               "--eps-sweep", "0,4/255,16/255", "--pgd-steps", "3", "--noise", "0.1", "--corruptions", "contrast",
               "--severities", "1,3", "--out", str(tmp_path / "a")])
    assert rc == 0
    rep = json.loads((tmp_path / "a" / "attack.json").read_text())
    assert len(rep["models"]) == 2
    for r in rep["models"].values():
        assert r["clean"]["top1"] > 0.6
        assert r["pgd"]["top1"][0] == r["clean"]["top1"]  # eps 0 is the clean accuracy
        assert r["corruptions"]["mce_vs_baseline"] == pytest.approx(100.0)
    assert _png(tmp_path / "a" / "attack.png")


@pytest.mark.slow
def test_cli_diagnose_mmseg_config(tmp_path):
    pytest.importorskip("mmseg")
    from pathlib import Path

    cfg = Path(__file__).parents[2] / "configs" / "mmseg" / "segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"
    rc = main(["diagnose", "--model", str(cfg), "--data", "digits", "--num-samples", "4", "--passes", "2",
               "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "diagnose.json").read_text())
    (r,) = rep["models"].values()
    assert r["layer_stack"] == "backbone.layers" and r["num_layers"] == 2
    assert all(v is not None for v in r["attention_sparsity"])


# ----------------------------------------------------------------------------------- datasets
def test_image_folder_and_digits_fallback(tmp_path, monkeypatch):
    import numpy as np
    from PIL import Image

    import pid_plugins.analysis.datasets as ds

    for c, name in enumerate(["cat", "dog"]):
        (tmp_path / name).mkdir()
        for i in range(3):
            Image.fromarray(np.full((10, 12, 3), 40 * (c + i), np.uint8)).save(tmp_path / name / f"{i}.png")
    data = ds.load_images(str(tmp_path))
    assert data.images.shape == (6, 3, 10, 12) and data.classes == ["cat", "dog"]
    assert data.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert data.images[4].max().item() == pytest.approx(80 / 255)
    monkeypatch.setattr(ds, "FASHION_MNIST_DIR", tmp_path / "absent")
    auto = ds.load_images("auto", "test")
    assert auto.source == "scikit-learn digits" and len(auto) == 297 and auto.images.shape[1:] == (1, 8, 8)
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        ds.load_images("fashion-mnist")


def test_fashion_mnist_when_installed():
    import pid_plugins.analysis.datasets as ds

    if not ds.fashion_mnist_available():
        pytest.skip("Debian package dataset-fashion-mnist not installed (make test installs it where apt works)")
    train, test = ds.load_images("fashion-mnist", "train"), ds.load_images("fashion-mnist", "test")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.images.shape[1:] == (1, 28, 28) and 0 <= train.images.min() and train.images.max() <= 1
    assert torch.bincount(test.labels).tolist() == [1000] * 10


@pytest.mark.slow
def test_text_corpora_are_real_and_split():
    from pid_plugins.analysis.datasets import load_text, split_blocks

    wiki = load_text("wiki")
    assert len(wiki) > 1_000_000 and "= " in wiki[:200]
    train, valid = split_blocks(list(wiki[:10_000].encode()), 100)
    assert train.shape == (90, 100) and valid.shape == (10, 100)
    with pytest.raises(ValueError, match="unknown text"):
        load_text("wikitext103")


# ----------------------------------------------------------------------------------- any registered method
@pytest.mark.slow
def test_cli_diagnose_builds_models_with_any_registered_method(tmp_path, capsys):
    """--attention/--attention-cfg: a method registered by the user (tests/toy_method.py) on a pid_* name and on a
    stock DeiT; its zero strength is the stock attention exactly, and the record names the method."""
    import toy_method  # noqa: F401  (registers scaled_reference)

    def diagnose(out, *options, model="pid_deit_tiny_patch16_224"):
        rc = main(["diagnose", "--model", model, "--model-kwargs", json.dumps(SMALL), *options, "--data", "digits",
                   "--num-samples", "8", "--passes", "0", "--out", str(tmp_path / out)])
        assert rc == 0
        (r,) = json.loads((tmp_path / out / "diagnose.json").read_text())["models"].items()
        return r

    label, soft = diagnose("softmax", "--attention", "softmax")
    assert label == "pid_deit_tiny_patch16_224 [softmax]" and soft["method"] == "softmax"
    _, zero = diagnose("zero", "--attention", "scaled_reference", "--attention-cfg", '{"gamma": 0}')
    label, strong = diagnose("strong", "--attention", "scaled_reference", "--attention-cfg", "strong")
    assert label == "pid_deit_tiny_patch16_224 [scaled_reference]"
    assert (zero["method"], zero["attention_cfg"]) == ("scaled_reference", {"gamma": 0.0})
    assert (strong["method"], strong["attention_cfg"]) == ("scaled_reference", {"gamma": 2.0})
    assert zero["mean_cosine"] == soft["mean_cosine"]  # same seed, same weights: gamma 0 is the stock attention
    assert strong["mean_cosine"] != soft["mean_cosine"]
    # a stock timm DeiT is converted (weights kept); without --attention a model reports what it runs
    _, converted = diagnose("converted", "--attention", "scaled_reference", "--attention-cfg", '{"gamma": 2}',
                            model="deit_tiny_patch16_224")
    assert converted["method"] == "scaled_reference" and converted["attention_cfg"] == {"gamma": 2.0}
    _, default = diagnose("default")
    assert default["method"] == "pid" and default["attention_cfg"]["lambda_p"] == 0.8
    assert "scaled_reference" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_attack_takes_a_built_in_sibling_with_its_parameters(tmp_path, capsys):
    """``attack --attention value_residual --attention-cfg ...`` on a timm name: the record names the method and its
    parameters (diagnose with a method and its zero parameters: the test above)."""
    rc = main(["attack", "--model", "pid_deit_tiny_patch16_224", "--model-kwargs", json.dumps(SMALL), "--attention",
               "value_residual", "--attention-cfg", '{"lambda_1": 0.3, "lambda_2": 0.9}', "--data", "digits",
               "--num-samples", "8", "--pgd-steps", "1", "--eps-sweep", "0,4/255", "--corruptions", "contrast",
               "--severities", "1", "--out", str(tmp_path)])
    assert rc == 0
    (label, attacked), = json.loads((tmp_path / "attack.json").read_text())["models"].items()
    assert label == "pid_deit_tiny_patch16_224 [value_residual]" and attacked["method"] == "value_residual"
    assert attacked["attention_cfg"] == {"lambda_1": 0.3, "lambda_2": 0.9, "learnable": False}
    assert attacked["pgd"]["top1"][0] == attacked["clean"]["top1"]
    assert "(value_residual): clean" in capsys.readouterr().out


def test_cli_attention_on_transformers_folders(tmp_path, tiny_llamas, capsys):
    import toy_method  # noqa: F401

    text = tmp_path / "text.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 60)
    rc = main(["attack", "--model", str(tiny_llamas[0]), "--model", str(tiny_llamas[1]), "--model",
               str(tiny_llamas[1]), "--attention", "scaled_reference", "--attention", "softmax", "--attention", "pid",
               "--attention-cfg", '{"gamma": 2}', "--attention-cfg", "null", "--attention-cfg", '{"lambda_p": 0}',
               "--data", str(text), "--num-samples", "4", "--seq-len", "32", "--rates", "0", "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "attack.json").read_text())["models"]
    sr, soft, pid0 = rep["softmax [scaled_reference]"], rep["pid [softmax]"], rep["pid [pid]"]
    assert (sr["method"], sr["attention_cfg"]) == ("scaled_reference", {"gamma": 2.0})
    assert soft["method"] == "softmax" and pid0["method"] == "pid" and pid0["attention_cfg"]["lambda_p"] == 0
    assert sr["perplexity"] != soft["perplexity"]
    assert "pid [softmax] (softmax): ppl@0%" in capsys.readouterr().out
