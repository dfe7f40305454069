"""Wire schemas (pydantic), one module per protocol: lenient on input, exact on output."""
