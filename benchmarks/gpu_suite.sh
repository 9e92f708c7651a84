#!/usr/bin/env bash
# The GPU suite: one command on a CUDA machine with torch and transformers, no network, sized for one 9-minute call.
# Packages opdcache needs that such a machine may lack travel as wheels in .whl/ (see BENCHMARKS.md for the list);
# SmolLM2's config and tokenizer in .gpu/smollm2/ (copied from a converted model directory, no weights).
# First the import gate (benchmarks/preflight.py imports every module: a missing package stops the suite in seconds,
# before any section). Then, in the order of what they decide: with nothing else on the GPU, the generate (the rollout
# engine against model.generate) and exact (--exact --device cuda against the default engine) sections; then the
# gpu-marked tests (tests/test_gpu.py, 120 s a test at most where pytest-timeout is installed) while the cli section
# builds the train step's cache and audits it; then the train section. async (K = 2 against K = 0), quantize (w4a16
# rollouts against bf16), divergence, score and write run on request (SECTIONS=generate,exact,train,async,quantize, ...;
# their last figures in BENCHMARKS.md stand). Its time on a device has not been measured since this order: every phase
# runs under what is left of BUDGET seconds (default 530, which leaves a 9-minute call's margin), so a slow section
# ends the suite with what it measured instead of taking the lease; each section's seconds are in results.json.
# results.json is rewritten as each section ends; a failing section is a row with its error (the traceback in
# bench_gpu.log) and the next section runs. --gen-rounds 2 shortens it, below BENCHMARKING.md's 3 rounds, and a
# table measured so must say it. Extra arguments go to the sections.
# Writes $OUT/tests.log, $OUT/cli.log, $OUT/bench_gpu.log, $OUT/gpu/{results.json,table.md} and the cli section's rows
# in $OUT/gpu-cli/results.json (OUT defaults to ./gpu-results).
#
#     bash benchmarks/gpu_suite.sh [extra bench_gpu.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
# opdcache as the wheel lays it out (cli/ is the package opdcache.cli), without pip: a copy on PYTHONPATH
rm -rf /tmp/opdcache-src && mkdir -p /tmp/opdcache-src && cp -r opdcache /tmp/opdcache-src/ && cp -r cli /tmp/opdcache-src/opdcache/cli
export PYTHONPATH="/tmp/opdcache-src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OPDCACHE_PROGRESS=0
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/opdcache-site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/opdcache-site"
fi
smollm2=()
[ -f .gpu/smollm2/config.json ] && smollm2=(--smollm2 "$REPO/.gpu/smollm2")
cd /tmp  # not the repository root: its opdcache/ (no cli inside) would shadow the copy
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
python3 "$REPO/benchmarks/preflight.py" | tee "$OUT/preflight.log" || { echo "opdcache does not import here: carry the missing packages as wheels in .whl/"; exit 2; }
deadline=$((SECONDS + ${BUDGET:-530}))
left() { echo $(( deadline - SECONDS > 10 ? deadline - SECONDS : 10 )); }
WORK=$(mktemp -d /tmp/bench-gpu-XXXXXX)
# the sections that need no cache and decide the most run first, with nothing else on the GPU; then the tests beside the
# cli section (which builds the train step's cache and audits its bf16 tables); then the rest, appended to results.json
all=${SECTIONS:-generate,exact,train}
first=$(echo "$all" | tr , '\n' | grep -E '^(generate|exact)$' | paste -sd, || true)
rest=$(echo "$all" | tr , '\n' | grep -vE '^(generate|exact)$' | paste -sd, || true)
set +e
: > "$OUT/bench_gpu.log"
[ -n "$first" ] && timeout "$(left)" python3 "$REPO/benchmarks/bench_gpu.py" --device cuda "${smollm2[@]}" --workdir "$WORK" \
    --sections "$first" --out "$OUT/gpu" "$@" 2>&1 | tee -a "$OUT/bench_gpu.log"
timeout "$(left)" python3 "$REPO/benchmarks/bench_gpu.py" --device cuda "${smollm2[@]}" --workdir "$WORK" --sections cli \
    --out "$OUT/gpu-cli" "$@" > "$OUT/cli.log" 2>&1 &
cli=$!
# -o addopts="": in this process, not pytest-xdist workers (the GPU machine has no xdist; one GPU, one process)
per_test=(); python3 -c "import pytest_timeout" 2>/dev/null && per_test=(-p timeout --timeout 120)
timeout "$(( $(left) < 300 ? $(left) : 300 ))" python3 -m pytest -q -o addopts="" -m gpu -p no:cacheprovider "${per_test[@]}" \
    "$REPO/tests/test_gpu.py" 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
wait $cli
clirc=$?
echo "gpu tests: exit $tests; cli section: exit $clirc"
[ -n "$rest" ] && timeout "$(left)" python3 "$REPO/benchmarks/bench_gpu.py" --device cuda "${smollm2[@]}" --workdir "$WORK" \
    --sections "$rest" --out "$OUT/gpu" --append "$@" 2>&1 | tee -a "$OUT/bench_gpu.log"
set -e
exit $(( tests != 0 || clirc != 0 ))
