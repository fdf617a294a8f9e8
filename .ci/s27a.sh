# Twenty-seventh session's device calls (scratch; removed before the session ends).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
filter() { grep -vE "Warning|warn|cudagraph|^W[0-9]"; }
timeout 230 .ci/run-gpu -k "staged or paged_decode_matches_sdpa or programmatic_paged_decode or gemv_matches or fused_qkv or rope_epilogue or graphs_equal or matches_reference_path" --tb=short > "$OUT/tests.log" 2>&1
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/tests.log" | tail -12
cd /tmp
for flags in "--batch 16" "--batch 16 --no-mma-staged" "--batch 16 --paged-wide 0 0" "--batch 16 --no-mma-staged --paged-wide 0 0" "--batch 16 --context 440" "--batch 16 --context 440 --paged-wide 0 0" "--batch 16 --context 1000 --paged-wide-max-tokens 2048" "--batch 16 --context 1000" "" "--batch 16"; do
  timeout 80 python3 -m tinyloop_hf.eval.ablate_decode $flags 2>&1 | filter | tail -1
done | tee "$OUT/ablate.log"
timeout 80 python3 -m tinyloop_hf.eval.replay_timeline --batch 16 2>&1 | filter | head -12 | tee -a "$OUT/ablate.log"
