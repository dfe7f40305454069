"""Models answered in one forward pass a batch, beside the LLM engine: embeddings, classifiers and rerankers
(`text`), TorchScript models (`torchscript`) and the dynamic batcher that serves them all (`batcher`:
requests gathered for `max_batch_delay` into one forward on the model's torch thread)."""
