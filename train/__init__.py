"""flashtrain.train: the loop (trainer.py), the step runners, the stability guard, construction, the
optimizers, schedule, balancing, checkpoints, metrics and the official import / export (DESIGN.md
"Training"; docs/layout.md lists the modules)."""
