"""Short layer plans for the tests that build or run flash_tiny: Hydra overrides that keep the CSA2 roles
of the published 40-layer pattern (V41_SPEC §2, model/layer_plan.py) in fewer layers, so a test pays for
the roles, not for the depth. launch/fuzz_restarts.py keeps its own copy of FOUR_LAYERS (a tool, it does
not import the tests)."""

# SWA, SWA + Engram, Full (ratio 2, kv / index / candidate source), Reuse
FOUR_LAYERS = ["model.n_layers=4", "model.compress_ratios=[0,0,2,2]", "model.kv_source_layers=[2]",
               "model.index_source_layers=[2]", "model.candidate_source_layer=2", "model.engram_layer_ids=[1]"]

# every role of the 40 layers, both Engram modules, and a kv source per compression ratio:
# 0 SWA | 1 SWA + Engram | 2 Full (ratio 2) | 3 Reuse | 4 Reuse + Engram | 5 Full (ratio 1, candidate source)
# | 6 Reindex (restricted to the candidates) | 7 Reuse of the reindexed top-k
EIGHT_LAYERS = ["model.n_layers=8", "model.compress_ratios=[0,0,2,2,2,1,1,1]", "model.kv_source_layers=[2,5]",
                "model.index_source_layers=[2,5,6]", "model.candidate_source_layer=5",
                "model.engram_layer_ids=[1,4]"]
