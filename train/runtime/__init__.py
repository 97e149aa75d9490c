"""flashtrain.train.runtime: the runtime guards -- the run lock and workers that die with their launcher
(run_guard.py), what a start writes once admitted (run_record.py), named collectives and their errors
(collectives.py), fault injection (faults.py)."""
