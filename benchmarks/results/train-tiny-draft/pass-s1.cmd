python -m dsserve.train.draft --seed 1 --problems 400 --threads 1 --examples /tmp/st_runs/examples-s1.pt --pass-only
