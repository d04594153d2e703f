#!/usr/bin/env bash
# The parity matrix: each layout trained twice with enable_deterministic_training=true, once with
# optimize_backward_concat=false and once with =true; the two loss curves must be bitwise equal.
#
#   bash scripts/numerics_matrix.sh [--gpu] [--out DIR] [--rows a,c]
#
# CPU size (default): model=tiny with 4 layers, 8 gloo ranks, a few steps. --gpu: model=small on 8 GPUs.
# --rows: only the rows with these letters (default: all).
# Rows whose capability is not built yet print "not supported yet" instead of failing the script. Exit
# code 1 if any built row is not bitwise equal.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=dump/numerics_matrix
ONLY=""
# Per-unit norms logged: compare_runs fails a row whose units' weights or gradients differ, even where
# the summed loss and grad norm round the difference away.
SIZE=(model=tiny model.n_layers=4 seq_len=32 steps=4 optim.warmup_steps=1 log_all_steps=true metrics.unit_norms=true)
LAYERS_PER_VIRTUAL_STAGE=1  # row (e): n_layers / (pp=2 x vpp=2)
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) SIZE=(model=small seq_len=1024 steps=20 log_all_steps=true metrics.unit_norms=true); LAYERS_PER_VIRTUAL_STAGE=2; shift ;;
    --out|--rows)
      [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; exit 2; }
      if [ "$1" = --out ]; then OUT="$2"; else ONLY=",$2,"; fi
      shift 2 ;;
    *) echo "usage: numerics_matrix.sh [--gpu] [--out DIR] [--rows a,c]" >&2; exit 2 ;;
  esac
done
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
TP2PP2DP2=(model_parallel_size=2 pipeline_parallel_size=2 batch_size=4 model.sequence_parallel=true)

# name | overrides
ROWS=(
  "a tp2 pp2 dp2 fp8 gpipe|${TP2PP2DP2[*]} pipeline_schedule=gpipe compute_dtype=bf16 model.use_fp8=true reshard_after_forward=false"
  "b tp2 dp4 bf16 microbatches|model_parallel_size=2 batch_size=4 microbatch_size=1 compute_dtype=bf16"
  "c tp2 pp2 dp2 bf16 gpipe|${TP2PP2DP2[*]} pipeline_schedule=gpipe compute_dtype=bf16"
  "d tp2 pp2 dp2 bf16 1f1b|${TP2PP2DP2[*]} pipeline_schedule=1f1b compute_dtype=bf16"
  "e tp2 pp2 dp2 bf16 interleaved vpp=2|${TP2PP2DP2[*]} pipeline_schedule=interleaved_1f1b num_layers_per_virtual_pipeline_stage=$LAYERS_PER_VIRTUAL_STAGE compute_dtype=bf16"
)

if [ -n "$ONLY" ]; then
  if ! [[ "$ONLY" =~ ^,[a-z](,[a-z])*,$ ]]; then
    echo "error: --rows takes row letters separated by commas, e.g. --rows a,c (got '${ONLY:1:-1}')" >&2
    exit 2
  fi
  for letter in $(echo "${ONLY//,/ }"); do
    if ! printf '%s\n' "${ROWS[@]}" | grep -q "^$letter "; then
      echo "error: --rows: no row '$letter' (rows: $(printf '%s\n' "${ROWS[@]}" | cut -c1 | paste -sd' '))" >&2
      exit 2
    fi
  done
fi

status=0
printf '| %-38s | %-60s |\n' "config (8 ranks)" "optimize_backward_concat off vs on"
printf '|%s|%s|\n' "$(printf -- '-%.0s' {1..40})" "$(printf -- '-%.0s' {1..62})"
for row in "${ROWS[@]}"; do
  name="${row%%|*}"
  read -r -a overrides <<< "${row#*|}"
  slug="${name%% *}"
  [ -z "$ONLY" ] || [[ "$ONLY" == *",$slug,"* ]] || continue
  result=""
  for concat in false true; do
    dump="$OUT/$slug-concat_$concat"
    rm -rf "$dump"
    mkdir -p "$OUT"
    if ! OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node=8 train.py \
        dump_dir="$dump" enable_deterministic_training=true optimize_backward_concat=$concat \
        "${SIZE[@]}" "${overrides[@]}" > "$dump.log" 2>&1; then
      # Only a capability the row itself lacks (the trainer's own refusal line; the phrase elsewhere in a
      # log proves nothing): the concat=true run failing where =false ran is a failure.
      unsupported='^error: [a-z_.0-9]+=[^ ]* is not supported yet'
      if [ "$concat" = false ] && grep -qE "$unsupported" "$dump.log"; then
        result="not supported yet ($(grep -oE "$unsupported" "$dump.log" | head -1 | sed 's/^error: //'))"
      else
        result="FAILED (see $dump.log)"
        status=1
      fi
      break
    fi
  done
  inert='import json, sys; sys.exit("optimize_backward_concat" in json.load(open(sys.argv[1]))["inert_keys"])'
  if [ -z "$result" ] && ! "$PY" -c "$inert" "$OUT/$slug-concat_true/layout.json" 2> /dev/null; then
    result="FAILED: optimize_backward_concat changes nothing on this layout (one microbatch?): nothing tested"
    status=1
  fi
  if [ -z "$result" ]; then
    # The verdict, or compare_runs' error (its last stderr line) when it has none; notes stay in the .err file.
    result=$("$PY" scripts/compare_runs.py "$OUT/$slug-concat_false" "$OUT/$slug-concat_true" --brief \
             2> "$OUT/$slug-compare.err") || status=1
    [ -n "$result" ] || result=$(tail -n 1 "$OUT/$slug-compare.err")
  fi
  printf '| %-38s | %-60s |\n' "$name" "$result"
done
exit $status
