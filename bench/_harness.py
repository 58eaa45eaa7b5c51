"""What every overhead benchmark shares: interleaved timing, medians, peak memory, the machine description.

Method. The PID model and the stock model (same weights) live in ONE process. After warm-up they are run
alternately (stock, PID, stock, PID, ...; the order of the pair flips every repetition), so that load from
other processes, frequency changes and cache state hit both alike. Each side's figure is the median of its
repetitions; the reported ratio is the median over repetitions of PID/stock within the repetition (the
two runs of a repetition are adjacent in time, so slow drifts in load cancel). Absolute times on a shared
machine are noise, the ratio is the measurement.

Peak memory on the CPU (no allocator statistics there) is read from ``torch.profiler`` with
``profile_memory=True``: every allocation and free inside the profiled region is an event with a signed byte
count; sorted by time, their running sum is the memory allocated by the region, and its maximum is the peak
(bytes held before the region, i.e. parameters and inputs, are not counted; both sides are measured alike).
"""
from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

__all__ = ["interleaved", "peak_memory_bytes", "machine", "Row"]

Row = Dict[str, object]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(
    stock: Callable[[], object],
    pid: Callable[[], object],
    reps: int,
    warmup: int = 2,
    progress: Optional[Callable[[], None]] = None,
    min_time: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> Dict[str, float]:
    """Median times of ``stock`` and ``pid`` run alternately ``reps`` times each after ``warmup`` pairs.

    ``min_time`` (seconds): a repetition runs the function as many times as fits (at least once) so that
    very short workloads (decode of a few tokens, small N) are not dominated by timer granularity; the
    per-call time is reported. ``clock``: ``time.thread_time`` for single-threaded workloads on a loaded machine
    (CPU time of this thread: time the thread waits for a core is not counted). Returns the medians, the ratio PID/stock (median of the per-repetition ratios),
    the ratio of the medians and of the minima, the median of the per-repetition differences (PID - stock, seconds)
    and the spread (IQR / median) of each side.
    """
    for _ in range(warmup):
        stock(), pid()
    inner = 1
    if min_time > 0:
        t = max(_timed(stock), 1e-6)
        inner = max(1, int(min_time / t))
    ts: List[float] = []
    tp: List[float] = []

    def run(fn: Callable[[], object]) -> float:
        t0 = clock()
        for _ in range(inner):
            fn()
        return (clock() - t0) / inner

    for i in range(reps):
        if i % 2 == 0:
            ts.append(run(stock))
            tp.append(run(pid))
        else:
            tp.append(run(pid))
            ts.append(run(stock))
        if progress is not None:
            progress()
    ms, mp = statistics.median(ts), statistics.median(tp)
    # each repetition's two runs are adjacent in time, so they see the same load from other processes: the
    # median of the per-repetition ratios is the reported figure (the ratio of the medians is kept beside it)
    paired = statistics.median(p / s for s, p in zip(ts, tp))
    return {
        "stock_s": ms, "pid_s": mp, "ratio": paired, "ratio_of_medians": mp / ms,
        "ratio_of_minima": min(tp) / min(ts), "reps": reps,
        "median_diff_s": statistics.median(p - s for s, p in zip(ts, tp)),
        "inner": inner,
        "stock_spread": _spread(ts), "pid_spread": _spread(tp),
    }


def _spread(xs: List[float]) -> float:
    if len(xs) < 4:
        return float("nan")
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on the CPU while ``fn`` runs (torch.profiler memory events, running sum)."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> Dict[str, object]:
    """CPU model, cores, load, and library versions: printed beside every table."""
    info: Dict[str, object] = {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    for name in ("timm", "transformers", "mmseg", "mmengine", "fairseq"):
        try:
            mod = __import__(name)
            info[name] = getattr(mod, "__version__", "?")
        except Exception:  # noqa: BLE001 - a missing zoo is reported, not fatal
            info[name] = None
    return info
