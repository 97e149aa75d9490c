"""flashtrain.train: configuration loading now; the loop, optimizers, schedule, balancing,
checkpoints and metrics land with their issues (DESIGN.md "Training")."""
