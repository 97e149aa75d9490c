"""flashtrain.parallel: how the network is spread over processes (mesh, pipeline, experts, data
parallel). Populated by the pipeline and expert-parallel issues; see DESIGN.md "Parallelism"."""
