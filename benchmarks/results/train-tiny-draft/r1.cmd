python -m dsserve.train.draft --problems 600 --time-limit 2700 --steps 100000 --batch 8 --lr 2e-3 --warmup 50 --heldout-n 0 --threads 1 --save-every 100 --out /tmp/st_runs/draft-r1
