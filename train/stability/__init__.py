"""flashtrain.train.stability: the stability guard (guard.py) with loss-spike detection, dropped updates and the
rollback (spike.py) and Anticipatory Routing (anticipatory.py); DESIGN.md "Stability", V41_SPEC §9."""
