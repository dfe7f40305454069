"""The engine: scheduler, model runner, sampling and detokenization. The only layer that runs torch."""
