"""flashtrain.train.plan: the offline planning tools -- the pipeline partition of a run (stages.py), the layout
search (layouts.py), the memory estimator (estimate.py) and the compile gate (compile_gate.py); launch/plan.py,
launch/estimate.py. Training reads only the partition."""
