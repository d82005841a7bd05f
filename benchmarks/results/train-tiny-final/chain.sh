#!/bin/bash
# usage (repo root, on the device): PLAN="r2:430" [INIT=dir] [EXTRA="flags"] OUT=dir bash benchmarks/results/train-tiny-final/chain.sh
# Stages chain, each starting from the one before; the last finished stage is tarred to $OUT after each stage.
# eval:N scores the last checkpoint on held-out problems EVAL_FIRST.. +N (one process per mode and task, EVAL_TL
# seconds at most, EVAL_DEVICE), then --merge's them (runs of several calls merge the same way) into $OUT/eval.tgz.
set -u
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/gpu.txt 2>&1
python -c "import torch, triton, rich; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt 2>&1
common="--device cuda --steps 1000000 --pack 2048 --batch 8 --warmup 50 --drills 30 --prompt-weight 0.5 --lr 1e-3 --log-every 50 --heldout-n 32 --min-back-low 16 --heldout-every 300"
init="${INIT:-}"
for st in $PLAN; do
  s=${st%%:*}; tl=${st##*:}
  if [ "$s" = eval ]; then  # eval:N: the last checkpoint, N held-out problems per task and mode, one process each
    m=$init; [ "$init" = dsserve/data/tiny-trained ] && m=tiny-trained  # the built-in name in eval.json
    for r in off on; do for c in cold hit; do for t in arithmetic retrieval chat; do
      d=$OUT/eval/$r-$c-$t-${EVAL_FIRST:-0}; mkdir -p $d
      OMP_NUM_THREADS=1 timeout ${EVAL_TL:-420} python -m dsserve.cli eval --model $m --device ${EVAL_DEVICE:-cuda} \
        --tasks $t --replay $r --cache $c -n $tl --first ${EVAL_FIRST:-0} --batch 128 --max-num-seqs 128 \
        --max-num-batched-tokens 8192 --out $d > $d/log 2>&1 &
    done; done; done
    wait
    python -m dsserve.cli eval --merge $OUT/eval/*-*-* --out $OUT/eval > $OUT/eval/merged.log 2>&1
    tar czf $OUT/eval.tgz -C $OUT eval && rm -rf $OUT/eval  # one file: a call brings back only a few
    continue
  fi
  case $s in
    r2) extra="--min-back 64 --dense-share 1.0 --warm-in-start 1.0 --warm-in-end 1.0 --mix arithmetic=0.2,retrieval=0.7,chat=0.1 --seed 21";;
    r3) extra="--init $init --min-back 128 --dense-share 1.0 --warm-in-start 1.0 --warm-in-end 1.0 --mix arithmetic=0.15,retrieval=0.8,chat=0.05 --seed 31";;
    r4) extra="--init $init --dense-share 1.0 --warm-in-start 0.1 --warm-in-end 0.6 --kl-weight 0.5 --mix arithmetic=0.2,retrieval=0.7,chat=0.1 --seed 41";;
    r5) extra="--init $init --dense-share 0.0 --kl-weight 0.5 --mix arithmetic=0.3,retrieval=0.6,chat=0.1 --seed 51";;
    r6) extra="--init $init --dense-share 0.0 --kl-weight 0.5 --mix arithmetic=0.3,retrieval=0.6,chat=0.1 --seed 61";;
  esac
  cmd="python -m dsserve.train.train $common --time-limit $tl $extra ${EXTRA:-} --out ck_$s"
  echo "$cmd" > $OUT/$s.cmd
  PYTHONPATH=. $cmd > $OUT/$s.log 2>&1
  echo "rc=$?" >> $OUT/$s.log
  cp ck_$s/train.json $OUT/$s.train.json 2>/dev/null; cp ck_$s/loss.png $OUT/$s.loss.png 2>/dev/null
  init=ck_$s
  rm -f $OUT/ck.tar.part-*; tar cf - -C $init --transform "s,^\\.,ck," . | split -b 15m - $OUT/ck.tar.part-
done
ls -la $OUT
