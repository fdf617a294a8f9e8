# Twenty-seventh session's device calls (scratch; removed before the session ends).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
filter() { grep -vE "Warning|warn|cudagraph|^W[0-9]"; }
timeout 90 .ci/run-gpu -k "staged or programmatic_paged_decode" --tb=short > "$OUT/tests.log" 2>&1
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/tests.log" | tail -12
cd /tmp
for flags in "--batch 16 --no-mma-staged" "--batch 16 --mma-staged"; do
  timeout 50 python3 -m tinyloop_hf.eval.ablate_decode $flags 2>&1 | filter | tail -1
done | tee "$OUT/ablate.log"
staged=$(grep ", staged" "$OUT/ablate.log" | grep -o '[0-9.]* ms per' | head -1 | cut -d' ' -f1)
unstaged=$(grep unstaged "$OUT/ablate.log" | grep -o '[0-9.]* ms per' | head -1 | cut -d' ' -f1)
if [ -n "$staged" ] && [ -n "$unstaged" ] && ! grep -q FAILED "$OUT/tests.log" && awk "BEGIN{exit !($staged < $unstaged)}"; then
  echo "bench with staging ($staged vs $unstaged)"
  sed -i 's/^MMA_STAGED = False/MMA_STAGED = True/' "$(python3 -c 'import tinyloop_hf.kernels.ops_cuda as m; print(m.__file__)')"
fi
left=$((480 - SECONDS))
timeout $left tinyloop-bench --bits 4 --batch 1 16 --no-gemv --peers eager --peer-batches 1 --out "$OUT/bench" \
    --baseline "$OLDPWD/eval/results/bench-h200.json" 2>&1 | filter | tail -14
