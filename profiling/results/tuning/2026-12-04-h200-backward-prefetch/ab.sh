# The table with the N = 4,097-8,192 backward rung as it was (2 rows x 16 warps) and as it is (1 row x 16
# warps, prefetch), each run twice, in turn: OUT=DIR bash profiling/results/tuning/2026-12-04-h200-backward-prefetch/ab.sh
# from the repository root writes DIR/ab-{old,new,old2,new2}.json.
set -e
J=bwd:16:5120,bwd:16:7168,bwd:16:8192,bwd:2048:5120,bwd:2048:7168,bwd:2048:8192,bwd:8192:5120,bwd:8192:7168,bwd:8192:8192,bwd:16384:5120,bwd:16384:8192,add_bwd:16384:5120:3,add_bwd:16:8192:2,add_bwd:8192:5120:2,add_bwd:2048:5120:3
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r torch_rmsnorm_op profiling /tmp/old/
sed -i 's/    (8192, 8192, 16, dict(prefetch=True)),/    (8192, 16384, 16, {}),/' /tmp/old/torch_rmsnorm_op/config.py
grep -c '(8192, 16384, 16, {})' /tmp/old/torch_rmsnorm_op/config.py
for side in old new old2 new2; do
  case $side in old*) dir=/tmp/old;; *) dir=.;; esac
  (cd $dir && python profiling/tune.py --out $OUT --tag ab-$side --table-only --rounds 3 --jobs $J 2>&1 | grep -v -i warn | cut -c1-30,240-300)
done
