#!/usr/bin/env bash
# The prepared device run (issue 53): on a fresh GPU machine, in at most 9 minutes,
#   1. installs the carried pure-Python wheels (make device-wheels: transformers, timm at constraints.txt's pins) and
#      the project, --no-deps, into a folder put first on PYTHONPATH (torch, Triton and the rest stay the image's),
#   2. runs the suite on the device: pytest tests/core/test_device.py --device $DEVICE,
#   3. runs the GPU bench: bench/device/gpu_bench.py (each method / stock, CUDA events, peak memory),
# and leaves under $OUT: run.log, env.txt, test_device.log, test_device.xml, gpu_bench.log, gpu_bench.json, gpu_profile.txt,
# gpu_bench.md (8 files: the device tool brings back at most 8). The last lines printed are the bench's table.
#
# On the device (the `device` tool's run, timeout_s 600, carry [".device-wheels"]):
#     bash bench/device/run.sh
# The dry run here (tests/research/test_device_script.py): DEVICE=cpu BENCH_ARGS="--tiny --compile-backend eager" \
#     PYTEST_ARGS="-k ..." OUT=/tmp/o bash bench/device/run.sh
# Knobs (environment): DEVICE (cuda), OUT (bench_device_out), WHEELS (.device-wheels), PYTHON (python3), SITE
# (/tmp/site), WORKERS (4: pytest-xdist workers; 0: none), PYTEST_ARGS, TEST_TIMEOUT (150 s), BENCH_ARGS,
# BENCH_TIMEOUT (330 s), BUDGET (270 s: the bench skips the rows it has no time left for).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-bench_device_out}
WHEELS=${WHEELS:-.device-wheels}
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
WORKERS=${WORKERS:-4}
PYTEST_ARGS=${PYTEST_ARGS:-}
TEST_TIMEOUT=${TEST_TIMEOUT:-150}
BENCH_ARGS=${BENCH_ARGS:-}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}
BUDGET=${BUDGET:-270}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 KINETO_LOG_LEVEL=5
mkdir -p "$OUT"
START=$(date +%s)
log() { echo "[run.sh +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/run.log"; }
status=0

# ---- 1. install: the carried wheels and the project, --no-deps, never torch
log "device $DEVICE, python $($PYTHON -c 'import sys; print(sys.version.split()[0])'), out $OUT"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  log "installing ${#wheels[@]} carried wheels into $SITE: ${wheels[*]##*/}"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" \
    2>&1 | tee -a "$OUT/run.log" || { log "FAILED: installing the wheels"; exit 2; }
elif [ "$DEVICE" != cpu ]; then
  log "FAILED: no wheels in $WHEELS: run make device-wheels here and carry $WHEELS"; exit 2
else
  log "no wheels in $WHEELS (dry run): this environment's transformers and timm"
fi
# (pip builds in the tree: build/ and the egg-info it leaves are removed unless they were there before)
leftovers=(); for d in build pid_plugins.egg-info; do [ -e "$d" ] || leftovers+=("$d"); done
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
  --target "$SITE" . 2>&1 | tee -a "$OUT/run.log" \
  || { log "FAILED: the project did not install into $SITE (pyproject needs setuptools >= 77)"; exit 2; }
[ ${#leftovers[@]} -eq 0 ] || rm -rf "${leftovers[@]}"
# the installed project and the wheels first (over the image's packages). What runs is the project as installed,
# this checkout's build: the sources alone lack pid_plugins.registry (registry/ at the top, mapped at install), so
# python runs with -P (no current folder on sys.path) and pytest with -o pythonpath= (pyproject's pythonpath ["."])
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -P - "$SITE" > "$OUT/env.txt" 2>&1 <<'EOF'
import os, sys, importlib
site = os.path.realpath(sys.argv[1])
for name in ("torch", "triton", "transformers", "timm", "huggingface_hub", "tokenizers", "safetensors", "pid_plugins"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')} {os.path.dirname(m.__file__)}")
    except Exception as err:  # noqa: BLE001
        print(f"{name} MISSING {type(err).__name__}: {err}")
import torch
assert not os.path.realpath(torch.__file__).startswith(site), "torch must stay the image's"
import pid_plugins, pid_plugins.hf  # the product must import (its registry/ with it): else stop
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
rc=$?
command -v nvidia-smi >/dev/null \
  && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tee -a "$OUT/run.log"
[ $rc -eq 0 ] || { log "FAILED: the environment check (env.txt)"; exit 2; }

# ---- 2. the suite on the device
xdist=()
[ "$WORKERS" != 0 ] && xdist=(-n "$WORKERS")
log "tests: pytest tests/core/test_device.py --device $DEVICE ${xdist[*]} $PYTEST_ARGS (timeout ${TEST_TIMEOUT}s)"
# shellcheck disable=SC2086  # PYTEST_ARGS is split like a command line
eval timeout "$TEST_TIMEOUT" "$PYTHON" -P -m pytest -q -p no:cacheprovider -o pythonpath= tests/core/test_device.py \
  --device "$DEVICE" "${xdist[@]}" --junitxml "$OUT/test_device.xml" $PYTEST_ARGS > "$OUT/test_device.log" 2>&1
rc=$?
tail -n 15 "$OUT/test_device.log" | tee -a "$OUT/run.log"
log "tests: exit $rc"
[ $rc -eq 0 ] || status=1

# ---- 3. the GPU bench
log "bench: gpu_bench.py --device $DEVICE --budget-s $BUDGET $BENCH_ARGS (timeout ${BENCH_TIMEOUT}s)"
# shellcheck disable=SC2086
timeout "$BENCH_TIMEOUT" "$PYTHON" bench/device/gpu_bench.py --device "$DEVICE" --out "$OUT" --budget-s "$BUDGET" \
  $BENCH_ARGS 2>&1 | grep -v -E "^(USDT|ERROR):.*(profiler_st|gpuGetDeviceCount)" | tee "$OUT/gpu_bench.log"
rc=$?
log "bench: exit $rc"
[ $rc -eq 0 ] || status=1
[ -f "$OUT/gpu_bench.md" ] && cat "$OUT/gpu_bench.md"
log "done: exit $status; files: $(ls "$OUT" | tr '\n' ' ')"
exit $status
