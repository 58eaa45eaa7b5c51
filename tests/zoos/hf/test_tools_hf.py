"""transformers' tools on a saved PID Llama, run as a user runs them through ``pid-plugins run``."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

from tool_cases import check, hf_pair, launch, read_json, save_pid_llama, tools_env  # noqa: E402

PROMPT = "the cat sat on the mat."
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pid_llama")
    save_pid_llama(folder)
    return folder


@pytest.fixture(scope="module")
def pair(checkpoint):
    return hf_pair(checkpoint)


def _ids(checkpoint: Path, text: str = PROMPT) -> torch.Tensor:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)(text, return_tensors="pt").input_ids


def _assert_pid_not_softmax(logits, pair, ids):
    pid, softmax = pair
    with torch.no_grad():
        ours, stock = pid(ids).logits, softmax(ids).logits
    got = torch.tensor(logits)
    assert (stock - ours).abs().max() > 0.05, "PID and softmax agree on this checkpoint: the test could not fail"
    assert got.shape == ours.shape
    assert torch.allclose(got, ours, atol=ATOL), f"max |tool - PID| = {(got - ours).abs().max():.3g}"


PIPELINE = """
import json, sys
from transformers import pipeline

pipe = pipeline("text-generation", model=sys.argv[1], device="cpu")
out = pipe(sys.argv[3], max_new_tokens=12, do_sample=False, return_full_text=False)
ids = pipe.tokenizer(sys.argv[3], return_tensors="pt").input_ids
logits = pipe.model(ids).logits
json.dump({"text": out[0]["generated_text"], "logits": logits.tolist()}, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_pipeline_text_generation_computes_pid(checkpoint, pair, tmp_path):
    (tmp_path / "gen.py").write_text(PIPELINE)
    check(launch(["python", "gen.py", checkpoint, "out.json", PROMPT], tmp_path, adapters="hf"))
    out = read_json(tmp_path / "out.json")
    ids = _ids(checkpoint)
    _assert_pid_not_softmax(out["logits"], pair, ids)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    greedy = pair[0].generate(ids, max_new_tokens=12, do_sample=False)
    assert out["text"] == tok.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True)


ACCELERATE = """
import json, os, sys
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

accelerator = Accelerator(cpu=True)
model = accelerator.prepare(AutoModelForCausalLM.from_pretrained(sys.argv[1])).eval()
with torch.no_grad():
    logits = model(torch.tensor(json.loads(sys.argv[3]))).logits
parent = open(f"/proc/{os.getppid()}/cmdline").read().split("\\0") if os.path.isdir("/proc") else None
json.dump({"logits": logits.tolist(), "parent": parent, "processes": accelerator.num_processes}, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_accelerate_launch_worker_computes_pid(checkpoint, pair, tmp_path):
    """``accelerate launch`` starts the script in a subprocess of its own."""
    (tmp_path / "train.py").write_text(ACCELERATE)
    ids = _ids(checkpoint)
    command = ["accelerate", "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--cpu", "train.py", checkpoint, "out.json", json.dumps(ids.tolist())]
    check(launch(command, tmp_path, adapters="hf"))
    out = read_json(tmp_path / "out.json")
    assert out["processes"] == 1
    if out["parent"] is not None:  # the script ran in a child of accelerate's CLI (the launcher exec'd into it)
        assert any(Path(arg).name == "accelerate" for arg in out["parent"]), out["parent"]
    _assert_pid_not_softmax(out["logits"], pair, ids)
    bare = launch(command, tmp_path, launcher=False)
    assert bare.returncode != 0 and "pid" in bare.stderr, bare.stderr[-2000:]


DOCS = [{"context": "the cat sat", "target": " on the mat."}, {"context": "a dog ran", "target": " far away."},
        {"context": "birds fly", "target": " south, then north."}]


def _lm_eval_task(folder: Path) -> Path:
    """A loglikelihood task over a local JSONL file (offline): ``--include_path`` folder and data."""
    tasks = folder / "tasks"
    tasks.mkdir()
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "pid_tiny.yaml").write_text(textwrap.dedent(f"""\
        task: pid_tiny
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: loglikelihood
        doc_to_text: "{{{{context}}}}"
        doc_to_target: "{{{{target}}}}"
        target_delimiter: ""
        metric_list:
          - metric: perplexity
            aggregation: perplexity
            higher_is_better: false
        """))
    return tasks


def _loglikelihoods(model, checkpoint: Path):
    """Each document's log P(target | context) under ``model``, as lm-eval's HFLM scores it (the target's tokens
    are those of context + target after the context's; no special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    out = []
    for doc in DOCS:
        whole = tok(doc["context"] + doc["target"], return_tensors="pt").input_ids
        n = len(tok(doc["context"]).input_ids)
        with torch.no_grad():
            logp = torch.log_softmax(model(whole[:, :-1]).logits.float(), -1)[0]
        out.append(float(logp[torch.arange(n - 1, whole.shape[1] - 1), whole[0, n:]].sum()))
    return out


def _samples(out_dir: Path):
    """{context: loglikelihood} from lm-eval's ``--log_samples`` file."""
    files = sorted(out_dir.rglob("samples_pid_tiny_*.jsonl"))
    assert files, sorted(p.name for p in out_dir.rglob("*"))
    rows = [json.loads(line) for line in files[-1].read_text().splitlines()]
    return {r["doc"]["context"]: float(r["resps"][0][0][0]) for r in rows}


def _assert_loglikelihoods(got: dict, pair, checkpoint: Path):
    pid = _loglikelihoods(pair[0], checkpoint)
    softmax = _loglikelihoods(pair[1], checkpoint)
    tool = [got[d["context"]] for d in DOCS]
    assert max(abs(a - b) for a, b in zip(pid, softmax)) > 0.1, "PID and softmax agree: the test could not fail"
    assert tool == pytest.approx(pid, abs=1e-3), (tool, pid, softmax)


@pytest.mark.slow
def test_lm_eval_cli_computes_pid(checkpoint, pair, tmp_path):
    """``pid-plugins run -- lm_eval --model hf --model_args pretrained=DIR --tasks T --include_path tasks``."""
    env_dir = tools_env()
    tasks = _lm_eval_task(tmp_path)
    command = ["lm_eval", "--model", "hf", "--model_args", f"pretrained={checkpoint},dtype=float32", "--tasks",
               "pid_tiny", "--include_path", tasks, "--device", "cpu", "--batch_size", "1", "--log_samples",
               "--output_path", tmp_path / "out"]
    proc = check(launch(command, tmp_path, adapters="hf", extra_path=[env_dir]))
    _assert_loglikelihoods(_samples(tmp_path / "out"), pair, checkpoint)
    assert "LOAD REPORT" not in proc.stdout + proc.stderr  # loaded as saved: the method record loads, no report
    bare = launch(command, tmp_path, extra_path=[env_dir], launcher=False)
    assert bare.returncode != 0 and "pid" in bare.stderr, bare.stderr[-2000:]


@pytest.mark.slow
def test_lm_eval_cli_with_a_stock_attention_names_the_record_without_the_plugin(checkpoint, pair, tmp_path):
    """``lm_eval --model_args pretrained=DIR,attn_implementation=sdpa`` with no pid-plugins in the process (what
    transformers' refusal of ``pid`` suggests) evaluates softmax, and transformers' load report in its output names
    the method record the weights carry."""
    env_dir = tools_env()
    tasks = _lm_eval_task(tmp_path)
    model_args = f"pretrained={checkpoint},dtype=float32,attn_implementation=sdpa"
    command = ["lm_eval", "--model", "hf", "--model_args", model_args, "--tasks", "pid_tiny", "--include_path", tasks,
               "--device", "cpu", "--batch_size", "1", "--log_samples", "--output_path", tmp_path / "out"]
    proc = check(launch(command, tmp_path, extra_path=[env_dir], launcher=False))
    lines = (proc.stdout + proc.stderr).splitlines()
    assert any("LlamaForCausalLM LOAD REPORT" in line for line in lines), proc.stderr[-3000:]
    assert any("pid_plugins_method" in line and "UNEXPECTED" in line for line in lines), proc.stderr[-3000:]
    got = _samples(tmp_path / "out")
    softmax = _loglikelihoods(pair[1], checkpoint)
    assert [got[d["context"]] for d in DOCS] == pytest.approx(softmax, abs=1e-3)  # the case the report flags


SIMPLE_EVALUATE = """
import json, sys
import pid_plugins.hf  # noqa: F401
import lm_eval
from lm_eval.tasks import TaskManager

results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={sys.argv[1]},dtype=float32", tasks=["pid_tiny"],
                                  task_manager=TaskManager(include_path=sys.argv[2]), device="cpu", batch_size=1,
                                  log_samples=True)
json.dump({s["doc"]["context"]: float(s["resps"][0][0][0]) for s in results["samples"]["pid_tiny"]},
          open(sys.argv[3], "w"))
"""


@pytest.mark.slow
def test_lm_eval_simple_evaluate_after_the_import_computes_pid(checkpoint, pair, tmp_path):
    env_dir = tools_env()
    tasks = _lm_eval_task(tmp_path)
    (tmp_path / "evaluate.py").write_text(SIMPLE_EVALUATE)
    check(launch(["python", "evaluate.py", checkpoint, tasks, "out.json"], tmp_path, extra_path=[env_dir],
                 launcher=False))
    _assert_loglikelihoods(read_json(tmp_path / "out.json"), pair, checkpoint)


TEXTS = ["the cat sat on the mat.", "a dog ran far away.", "birds fly south, then north.", "the sun is up."]

SFT = """
import json, sys
import torch
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

dataset = load_dataset("json", data_files=sys.argv[3], split="train")
args = SFTConfig(output_dir=sys.argv[2], max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
                 report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, max_length=64,
                 model_init_kwargs={"dtype": "float32"}, bf16=False)
trainer = SFTTrainer(model=sys.argv[1], args=args, train_dataset=dataset)
trainer.train()
trainer.save_model(sys.argv[2])
model = trainer.model.eval()
with torch.no_grad():
    logits = model(torch.tensor(json.loads(sys.argv[4]))).logits
json.dump({"logits": logits.tolist()}, open(sys.argv[2] + "/logits.json", "w"))
"""


def _write_texts(path: Path) -> None:
    """The training texts as a local JSONL file (``datasets 5.2``'s ``Dataset.from_list`` fails to fingerprint an
    in-memory table with the pyarrow of constraints-tools.txt; a file is what users train on anyway)."""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))


def _assert_trained_pid(out_dir: Path, checkpoint: Path, pair, logits=None):
    """The folder TRL saved loads as PID with the plugin (config and weights), is not the untrained checkpoint,
    and (when given) the trainer's own model computed the same logits, not softmax's."""
    trained = hf_pair(out_dir)
    ids = _ids(checkpoint)
    with torch.no_grad():
        before = pair[0](ids).logits
        after = trained[0](ids).logits
    assert (after - before).abs().max() > 1e-3, "training changed nothing: the test could not tell"
    assert read_json(out_dir / "config.json")["attn_implementation"] == "pid"
    if logits is not None:
        _assert_pid_not_softmax(logits, trained, ids)


@pytest.mark.slow
def test_trl_sft_trainer_trains_pid(checkpoint, pair, tmp_path):
    """``SFTTrainer(model=DIR)`` in a user's script run through the launcher trains the PID model."""
    env_dir = tools_env()
    (tmp_path / "sft.py").write_text(SFT)
    _write_texts(tmp_path / "train.jsonl")
    out_dir = tmp_path / "sft_out"
    ids = _ids(checkpoint)
    check(launch(["python", "sft.py", checkpoint, out_dir, tmp_path / "train.jsonl", json.dumps(ids.tolist())], tmp_path,
                 adapters="hf", extra_path=[env_dir]))
    _assert_trained_pid(out_dir, checkpoint, pair, read_json(out_dir / "logits.json")["logits"])


def _trl_sft(checkpoint: Path, data: Path, out_dir: Path, *extra: str):
    return ["trl", "sft", "--model_name_or_path", checkpoint, "--dataset_name", data, "--output_dir", out_dir,
            "--max_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--report_to", "none",
            "--save_strategy", "no", "--use_cpu", "--max_length", "64", "--dtype", "float32", *extra]


@pytest.mark.slow
def test_trl_sft_cli_trains_pid(checkpoint, pair, tmp_path):
    """``pid-plugins run -- trl sft --model_name_or_path DIR --attn_implementation pid --dataset_name DATA ...``
    (offline, a local JSONL folder): the saved model is PID and trained; without the launcher TRL's CLI is refused
    (transformers' error)."""
    env_dir = tools_env()
    data = tmp_path / "data"
    data.mkdir()
    _write_texts(data / "train.jsonl")
    out_dir = tmp_path / "cli_out"
    command = _trl_sft(checkpoint, data, out_dir, "--attn_implementation", "pid")
    check(launch(command, tmp_path, adapters="hf", extra_path=[env_dir]))
    _assert_trained_pid(out_dir, checkpoint, pair)
    bare = launch(_trl_sft(checkpoint, data, tmp_path / "bare_out", "--attn_implementation", "pid"), tmp_path,
                  extra_path=[env_dir], launcher=False)
    assert bare.returncode != 0 and "pid" in bare.stderr, bare.stderr[-2000:]


@pytest.mark.slow
def test_trl_sft_cli_without_attn_implementation_trains_the_saved_method(checkpoint, pair, tmp_path):
    """TRL's CLI passes attn_implementation=None when the user gives none: the folder loads as saved (PID)."""
    env_dir = tools_env()
    data = tmp_path / "data"
    data.mkdir()
    _write_texts(data / "train.jsonl")
    proc = check(launch(_trl_sft(checkpoint, data, tmp_path / "out"), tmp_path, adapters="hf", extra_path=[env_dir]))
    saved = read_json(tmp_path / "out" / "config.json").get("attn_implementation")
    assert saved == "pid", (saved, proc.stderr[-2000:])
    _assert_trained_pid(tmp_path / "out", checkpoint, pair)
