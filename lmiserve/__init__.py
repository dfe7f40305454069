"""lmiserve: a continuous-batching LLM inference server speaking LMI, TGI and OpenAI protocols."""

__version__ = "0.1.0"
