"""The HTTP layer: a thin starlette app wiring protocol adapters, the engine and formatters."""
