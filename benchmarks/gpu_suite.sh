#!/usr/bin/env bash
# The GPU suite (issues 22 and 31): one command on a CUDA machine with torch and transformers, no network.
# Packages opdcache needs that such a machine may lack travel as wheels in .whl/ (see BENCHMARKS.md for the list);
# SmolLM2's config and tokenizer in .gpu/smollm2/ (copied from a converted model directory, no weights).
# In the order of what they decide: first, with nothing else on the GPU, the generate (the rollout engine against
# model.generate) and exact (--exact --device cuda against the default engine) sections; then the gpu-marked tests
# (tests/test_gpu.py) while the cli section builds the train step's cache and audits it; then the train, async (K = 2
# against K = 0) and quantize (w4a16 rollouts against bf16) sections. The divergence, scoring and write sections run on
# request (SECTIONS=divergence,score,write; their figures in BENCHMARKS.md stand); the default's time on an H200 is
# estimated at 7-9 minutes from the 2026-11-28 run, not measured (each section's seconds are now in results.json;
# --gen-rounds 2 shortens it, below BENCHMARKING.md's 3 rounds, and a table measured so must say it). results.json
# is rewritten as each section ends, so a run cut short keeps what it measured. Extra arguments go to the sections.
# Writes $OUT/tests.log, $OUT/cli.log, $OUT/bench_gpu.log and $OUT/gpu/{results.json,table.md,divergence.txt}
# (OUT defaults to ./gpu-results).
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
python3 -c "import opdcache.cli.main" || { echo "opdcache does not import here: carry the missing packages as wheels in .whl/"; exit 2; }
WORK=$(mktemp -d /tmp/bench-gpu-XXXXXX)
# the sections that need no cache and decide the most run first, with nothing else on the GPU; then the tests beside the
# cli section (which builds the train step's cache and audits its bf16 tables); then the rest, appended to results.json
all=${SECTIONS:-generate,exact,train,async,quantize}
first=$(echo "$all" | tr , '\n' | grep -E '^(generate|exact)$' | paste -sd, || true)
rest=$(echo "$all" | tr , '\n' | grep -vE '^(generate|exact)$' | paste -sd, || true)
bench() { python3 "$REPO/benchmarks/bench_gpu.py" --device cuda "${smollm2[@]}" --workdir "$WORK" "$@"; }
set +e
: > "$OUT/bench_gpu.log"
[ -n "$first" ] && bench --sections "$first" --out "$OUT/gpu" "$@" 2>&1 | tee -a "$OUT/bench_gpu.log"
bench --sections cli "$@" > "$OUT/cli.log" 2>&1 &
cli=$!
# -o addopts="": in this process, not pytest-xdist workers (the GPU machine has no xdist; one GPU, one process)
timeout 300 python3 -m pytest -q -o addopts="" -m gpu -p no:cacheprovider "$REPO/tests/test_gpu.py" 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
wait $cli
clirc=$?
echo "gpu tests: exit $tests; cli section: exit $clirc"
[ -n "$rest" ] && bench --sections "$rest" --out "$OUT/gpu" --append "$@" 2>&1 | tee -a "$OUT/bench_gpu.log"
set -e
exit $(( tests != 0 || clirc != 0 ))
