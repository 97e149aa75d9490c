"""flashtrain.train.dspark: the DSpark stage (stage.py: the frozen backbone, the drafter as the trained model, its
train module and step runner), its objective (loss.py) and greedy speculative decoding (speculative.py);
V41_SPEC §8b."""
