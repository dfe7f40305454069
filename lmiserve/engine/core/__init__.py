"""The engine core: the asyncio loop (`async_engine`), the scheduler over the KV blocks (`scheduler`, `block_scheduler`,
`kv_blocks`), the sequences (`sequence`) and the step contract that executors run (`step`)."""
