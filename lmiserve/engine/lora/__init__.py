"""LoRA adapters as plain data: the adapters' matrices and the batched products (`adapters`, `kernels`), the registry
that loads and holds them for requests (`registry`) and the manager beside each runner (`manager`)."""
