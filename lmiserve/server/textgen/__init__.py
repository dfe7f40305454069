"""What the TGI and OpenAI routes share, owned by neither protocol: the default LLM seen as a text
generator (`served`), TGI's limits and its parameter validation (which OpenAI requests are mapped onto),
the chat request body, admission, body decoding, timing headers, grouping events into finished
sequences, and the error shapes both protocols answer with.

Modules: limits, parameters, chat, validation, served, admission, body, timing, sequences, generation,
wire, errors.
"""
