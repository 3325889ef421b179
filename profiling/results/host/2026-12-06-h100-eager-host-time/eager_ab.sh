# Eager per-call host time before and after a change, alternating in rounds on one host.
# OLD: the package at 4604c33, exported from the repository root with
#   mkdir -p OLD && git archive 4604c33 torch_rmsnorm_op profiling/host_overhead.py | tar -x -C OLD
# Run from the repository root: OLD=OLD OUT=DIR bash eager_ab.sh
set -u
for r in 1 2 3; do
  for v in old new; do
    if [ "$v" = old ]; then s=$OLD/profiling/host_overhead.py; else s=profiling/host_overhead.py; fi
    python "$s" --eager-only --out "/tmp/ab-$v-$r" > "/tmp/ab-$v-$r.log" 2>&1 || tail -5 "/tmp/ab-$v-$r.log"
    cp "/tmp/ab-$v-$r/host_overhead.json" "$OUT/eager-$v-r$r.json"
    echo "$v r$r without the launch (CPU tensors): $(TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python "$s" --cpu 2>/dev/null | tail -1)"
  done
done
