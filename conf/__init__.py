"""flashtrain.config: the Hydra configuration tree (config.yaml, its groups and exp/, shipped as package
data) and the bottom module every package may import (`flashtrain.config.errors`, the one error family).

The code lives in `flashtrain.model`, `flashtrain.parallel`, `flashtrain.train` and `flashtrain.data` (the
folders model/, parallel/, train/, data/; pyproject.toml maps them). The typed config objects are built from
this tree once, at start-up, in `flashtrain.train.config`."""

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent  # config.yaml + the groups + exp/
