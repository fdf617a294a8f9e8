set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
filter() { grep -vE "Warning|warn|cudagraph|^W[0-9]"; }
timeout 200 .ci/run-gpu -k "paged_decode_matches_sdpa or programmatic_paged_decode" --tb=short > "$OUT/tests.log" 2>&1
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/tests.log" | tail -12
cd /tmp
for flags in "--batch 16" "--batch 16 --paged-wide 256 8" "--batch 16 --paged-wide 256 4" "--batch 16 --paged-wide 128 8" "--batch 16 --decode-ctas 256" "--batch 16 --kv-cache-dtype int8" "--batch 16 --kv-cache-dtype int8 --paged-wide 256 8" "--batch 16"; do
  timeout 80 python3 -m tinyloop_hf.eval.ablate_decode $flags 2>&1 | filter | tail -1
done | tee "$OUT/ablate.log"
timeout 80 python3 -m tinyloop_hf.eval.replay_timeline --batch 16 --paged-wide 256 8 2>&1 | filter | head -12 | tee -a "$OUT/ablate.log"
