"""The models of the real backend: the decoder, its weights and tokenizer, tensor-parallel
shards, CUDA graphs, the target's runner and the drafts."""
