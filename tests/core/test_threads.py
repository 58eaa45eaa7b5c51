"""Thread safety: forwards of PID models of every zoo in two threads at once equal the sequential ones, and the
per-forward PID state is never shared between threads (in one process: the engines' jobs are in test_distributed.py)."""
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

DIST = Path(__file__).resolve().parents[1] / "dist_workers"  # the tiny models the distributed workers use
sys.path.insert(0, str(DIST))
import pid_dist_cases as cases  # noqa: E402

# two threads each on a 2-core machine: under pytest-xdist these run on one worker, one after the other
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multiprocess")]


def _thread_jobs(tmp_path):
    """(name, forward) pairs: two timm PID DeiTs with different gains, one HF PID Llama at two batch sizes,
    a freshly built PID Llama whose first forwards race, an mmseg PID backbone and a fairseq PID LM."""
    import timm

    import pid_plugins.timm  # noqa: F401

    jobs = []
    torch.manual_seed(0)
    deit_a = timm.create_model("pid_deit_tiny_patch16_224", **cases.TIMM_TINY).eval()
    deit_b = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg=dict(lambda_p=0.9, lambda_i=0.1,
                                                                               lambda_d=0.3, beta=0.7),
                               **cases.TIMM_TINY).eval()
    deit_b.load_state_dict(deit_a.state_dict())  # same weights: only the gains differ
    for name, model, n in (("deit_a", deit_a, 3), ("deit_b", deit_b, 5)):
        x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))
        jobs.append((name, lambda m=model, x=x: m(x)))

    llama = cases.llama_model().eval()
    for n in (2, 5):
        ids = cases.token_rows(n, seed=n)
        jobs.append((f"llama_b{n}", lambda ids=ids: llama(ids).logits))

    import pid_plugins.mmseg  # noqa: F401  (before mmseg.models: it installs the mmcv._ext stand-in)
    from mmseg.registry import MODELS

    torch.manual_seed(0)
    seg = MODELS.build(dict(type="PIDVisionTransformer", img_size=(64, 64), patch_size=16, embed_dims=48,
                            num_layers=2, num_heads=3, with_cls_token=True, final_norm=True))
    seg.eval()  # mmseg's ViT.train() returns None: no chaining
    img = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    jobs.append(("mmseg", lambda: seg(img)[0]))

    from zoo_cases import fs_build, fs_dictionary

    lm = fs_build(fs_dictionary(tmp_path), layers=2)[0]
    toks = torch.randint(4, 44, (3, 12), generator=torch.Generator().manual_seed(4))
    jobs.append(("fairseq", lambda: lm(toks)[0]))
    return jobs, {"deit_a": deit_a, "deit_b": deit_b}


def test_concurrent_forwards_in_two_threads_equal_sequential_ones(tmp_path):
    for mod in ("timm", "transformers", "mmseg", "fairseq"):
        pytest.importorskip(mod)
    jobs, models = _thread_jobs(tmp_path)
    with torch.no_grad():
        want = {name: fn() for name, fn in jobs}
    # pairs that differ in model, gains or batch size run at the same time, many times, in both orders
    pairs = [("deit_a", "deit_b"), ("llama_b2", "llama_b5"), ("deit_a", "llama_b5"), ("mmseg", "fairseq"),
             ("fairseq", "llama_b2"), ("deit_b", "mmseg")]
    fns = dict(jobs)
    rounds = 12
    errors, mismatches = [], []

    def worker(names, barrier):
        try:
            with torch.no_grad():
                for r in range(rounds):
                    barrier.wait(timeout=60)
                    name = names[r % 2]
                    got = fns[name]()
                    if not torch.equal(got, want[name]):
                        mismatches.append((name, (got - want[name]).abs().max().item()))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    start = time.monotonic()
    for a, b in pairs:
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=worker, args=((a, b), barrier), daemon=True),
                   threading.Thread(target=worker, args=((b, a), barrier), daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a forward thread hung"
    assert not errors, errors[:3]
    assert not mismatches, mismatches[:5]
    assert time.monotonic() - start < 120
    # the two DeiTs share weights and differ only in gains: on the same images their outputs differ, so a
    # state or gain leaking from one to the other would have shown up above
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(models["deit_a"](x), want["deit_a"])
        assert not torch.allclose(models["deit_b"](x), want["deit_a"], atol=1e-4)


def test_first_forwards_of_a_fresh_hf_pid_model_racing_in_two_threads(tmp_path):
    """A model built with attn_implementation="pid" hooks itself on its first forward; two threads making
    that first forward at once must both get their own PID state (this failed before the adapter fix)."""
    pytest.importorskip("transformers")
    ids = {2: cases.token_rows(2, seed=1), 3: cases.token_rows(3, seed=2)}
    reference = cases.llama_model().eval()
    with torch.no_grad():
        want = {n: reference(x).logits for n, x in ids.items()}
    for trial in range(20):
        model = cases.llama_model().eval()
        barrier = threading.Barrier(2)
        got, errors = {}, []

        def first_forward(n):
            try:
                barrier.wait(timeout=60)
                with torch.no_grad():
                    got[n] = model(ids[n]).logits
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=first_forward, args=(n,), daemon=True) for n in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, f"trial {trial}: {errors[0][:300]}"
        for n in ids:
            assert torch.equal(got[n], want[n]), (trial, n)
        from pid_plugins.hf.forward import MethodForward

        ours = model.model.__dict__["forward"]
        assert isinstance(ours, MethodForward) and ours.inner is None, f"trial {trial}: {ours!r}"
