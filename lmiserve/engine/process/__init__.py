"""The engine core in a process of its own (`engine_process`, vLLM's engine-core process): `host.py` serves an
engine in that process, `client.py` is the serving process's `TextGenerator` over the pipe between them."""
