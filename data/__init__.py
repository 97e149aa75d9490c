"""flashtrain.data: tokenizer, webdataset shards, image processing, packing, mixing, resumable state.
Populated by the data issue; see DESIGN.md "Data"."""
