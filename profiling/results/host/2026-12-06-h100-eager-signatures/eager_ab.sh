# Eager per-call time before and after a change, alternating in rounds on one host.
# OLD: the package at eb829c9, exported from the repository root with
#   mkdir -p OLD && git archive eb829c9 torch_rmsnorm_op profiling/host_overhead.py | tar -x -C OLD
# Run from the repository root: OLD=OLD OUT=DIR bash eager_ab.sh
set -u
HERE=$(dirname "$0")
for r in 1 2 3 4 5; do
  for v in old new; do
    if [ "$v" = old ]; then root=$OLD; else root=.; fi
    echo "$v r$r $(python "$HERE/per_call_ab.py" "$root")"
  done
done > "$OUT/per-call-rounds.txt"
for r in 1 2 3; do
  for v in old new; do
    if [ "$v" = old ]; then s=$OLD/profiling/host_overhead.py; else s=profiling/host_overhead.py; fi
    python "$s" --eager-only --out "/tmp/ab-$v-$r" > "/tmp/ab-$v-$r.log" 2>&1 || tail -5 "/tmp/ab-$v-$r.log"
    cp "/tmp/ab-$v-$r/host_overhead.json" "$OUT/eager-$v-r$r.json"
  done
done
cp /tmp/ab-new-3/host_overhead_profile.txt "$OUT/"
