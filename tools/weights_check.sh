#!/usr/bin/env bash
# The weights_sha256 of a fixed set of short runs, one line each: "name sha256".
# A refactor keeps every line: run it before and after, on the same machine, and diff.
#   tools/weights_check.sh [REPO] > before.txt
# Every averager at N=1, N=3 and N=3 with a NaN mini-batch; the mlp; the
# exponential LR schedule; the tf2 engine alike; tf2 mirrored over 2 CPU replicas; tf2
# under XLA on the mlp (the convnet's XLA gradient needs --nodeterministic).
set -euo pipefail
repo=$(cd "${1:-$(dirname "$0")/..}" && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
[[ -x $py ]] || py=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--reps=1 --eval-every=0 --batch-size=10 --iterations=10 --seed=3)
run() {
  local name=$1; shift
  (cd "$repo" && "$py" main.py "${common[@]}" "$@" --results="$tmp/$name.json") >/dev/null 2>&1 \
    || { echo "$name FAILED"; return; }
  "$py" -c 'import json,sys; print(sys.argv[2], json.load(open(sys.argv[1]))["runs"][0]["weights_sha256"])' \
    "$tmp/$name.json" "$name"
}
for s in stack running graph fused optimizer; do
  run "$s-n1" --accumulate=$s --average-gradients=1
  run "$s-n3" --accumulate=$s --average-gradients=3
  run "$s-n3-nan" --accumulate=$s --average-gradients=3 --inject-nonfinite=4
done
run mlp-n3 --model=mlp --average-gradients=3
run fused-exp --accumulate=fused --average-gradients=3 --lr-schedule=exponential --lr-decay-steps=2 --lr-decay-rate=0.5
run tf2-n1 --engine=tf2 --average-gradients=1
run tf2-n3 --engine=tf2 --average-gradients=3
run tf2-n3-nan --engine=tf2 --average-gradients=3 --inject-nonfinite=4
run tf2-exp --engine=tf2 --average-gradients=3 --lr-schedule=exponential --lr-decay-steps=2 --lr-decay-rate=0.5
run tf2-mirrored2 --engine=tf2 --average-gradients=3 --distribute=mirrored --replicas=2
run tf2-jit-mlp-n3 --engine=tf2 --average-gradients=3 --model=mlp --jit-compile
