"""flashtrain.train.official: readers and writers for the official (published) checkpoint formats."""
