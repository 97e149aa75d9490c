"""flashtrain.train.evaluation: held-out evaluation through the run's own step runner (heldout.py), checkpoint
scoring (checkpoint.py: launch/evaluate.py) and the lm-evaluation-harness model (harness.py)."""
