"""The eager floor in instructions: stock, the hand-written reference and the plugin, each decoding under callgrind.

    python bench/eager_instructions.py                    # PID and NeuTRENO (five valgrind runs, two at a time)
    python bench/eager_instructions.py --methods pid

Wall time on a shared 2-core machine swings by 0.05 between runs, more than the 0.02 the eager floor asks for.
callgrind counts the instructions a process runs, the same count whatever else the machine does (within about 0.03%
here), so the ratios below resolve differences of 0.001. Each run is one process: it builds one model of the
host-cost decode shape (bench/eager_reference.py's), decodes twice to warm up, then decodes once (a 16-token prompt,
32 new tokens, ``generate``) with callgrind collecting only there, turned on and off by a client request from a tiny
C helper compiled here (gcc and valgrind's headers). A ratio is stock's instructions over the model's: tokens/s over
stock where a step is host time. Instructions are not seconds (an aten op's kernel and a Python call differ in
instructions per second), so this sits beside ``bench/eager_reference.py``'s timed ratios, not in place of them.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))

_HELPER = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_STOP_INSTRUMENTATION; }
"""

# one process: build the model, warm up, count one generate
_RUN = r"""
import ctypes, logging, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {bench!r})
import torch
torch.set_num_threads(1)
logging.getLogger("transformers").setLevel(logging.ERROR)
import eager_reference as er
from host_cost import DECODE_CFG, NEW_TOKENS, PROMPT
er.register()
model = er.llama({attn!r})
prompt = torch.randint(0, DECODE_CFG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))
def decode():
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
decode(); decode()
import gc
gc.collect()  # every run starts counting from the same collector state
helper = ctypes.CDLL({helper!r})
helper.cg_start(); decode(); helper.cg_stop()
"""


def _helper(folder: str) -> str:
    source, library = os.path.join(folder, "cg.c"), os.path.join(folder, "libcg.so")
    with open(source, "w") as f:
        f.write(_HELPER)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", library, source], check=True)
    return library


def count(attn: str, helper: str, folder: str) -> int:
    """The instructions one ``generate`` of the model with ``attn`` runs (callgrind's collected total)."""
    script = os.path.join(folder, f"run_{attn}.py")
    with open(script, "w") as f:
        f.write(_RUN.format(bench=HERE, attn=attn, helper=helper))
    out = os.path.join(folder, f"{attn}.callgrind")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
                           f"--callgrind-out-file={out}", sys.executable, script],
                          capture_output=True, text=True, env=env)
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind run of {attn!r} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return int(found.group(1))


def measure(methods: List[str], jobs: int = 2) -> List[Dict[str, object]]:
    """``[{method, stock, reference, plugin, ...}]``: instructions, and stock's over each (tokens/s over stock)."""
    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"bench/eager_instructions.py needs {' and '.join(missing)} (valgrind's headers too)")
    with tempfile.TemporaryDirectory() as folder:
        helper = _helper(folder)
        names = ["sdpa"] + [name for m in methods for name in (f"ref_{m}", m)]
        with ThreadPoolExecutor(jobs) as pool:
            counted = dict(zip(names, pool.map(lambda n: count(n, helper, folder), names)))
    stock = counted["sdpa"]
    rows = []
    for m in methods:
        reference, plugin = stock / counted[f"ref_{m}"], stock / counted[m]
        rows.append(dict(method=m, stock=stock, reference_instructions=counted[f"ref_{m}"],
                         plugin_instructions=counted[m], reference=reference, plugin=plugin, gap=reference - plugin))
    return rows


def markdown(rows: List[Dict[str, object]]) -> str:
    lines = ["The eager floor in instructions (callgrind, one `generate` of the host-cost decode shape): stock's "
             "instructions over each model's.", "",
             "| method | hand-written / stock | plugin / stock | gap (goal <= 0.02) | plugin - hand-written per step |",
             "|---|---|---|---|---|"]
    for r in rows:
        extra = (r["plugin_instructions"] - r["reference_instructions"]) / 33  # prefill + 32 steps
        lines.append(f"| {r['method']} | {r['reference']:.4f} | {r['plugin']:.4f} | {r['gap']:.4f} | "
                     f"{extra / 1e3:.0f}k instructions |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="pid,neutreno")
    p.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    print(f"eager_instructions: {1 + 2 * len(methods)} callgrind runs ({args.jobs} at a time, a few minutes each)",
          flush=True)
    print(markdown(measure(methods, args.jobs)))


if __name__ == "__main__":
    main()
