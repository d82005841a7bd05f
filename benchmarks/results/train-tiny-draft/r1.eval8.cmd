python -m dsserve.train.draft --eval-only --resume /tmp/st_runs/draft-r1/draft_state.pt --heldout-n 8 --threads 1 --out /tmp/st_runs/draft-r1-eval8
