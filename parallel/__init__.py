"""flashtrain.parallel: how the network is spread over processes (one topology object, ParallelDims;
pipeline, expert, context and data parallelism; sharded state). DESIGN.md "Parallelism"."""
