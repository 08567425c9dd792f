"""Pooling models (embeddings, reranking, classification): our BERT encoder, the pooling step,
loading from sentence-transformers folders and a batching engine of their own (no KV cache)."""
