"""flashtrain.data: tokenizer, webdataset shards, image processing, packing, mixing, resumable state
(DESIGN.md "Data"; data/README.md for the shard format)."""
