"""Executors: where a step's plain-data batch runs. In this process (`in_process`) or on tensor-parallel worker
processes (`tensor_parallel`, torch.distributed)."""
