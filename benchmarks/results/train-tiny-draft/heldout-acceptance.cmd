python -m dsserve.train.draft --eval-only --heldout-n 16 --threads 1 --out /tmp/st_runs/builtin-eval16
