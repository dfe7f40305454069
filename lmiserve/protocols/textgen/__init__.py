"""What the TGI, OpenAI and Anthropic routes share, owned by neither protocol (a neutral helper under protocols/;
server/ keeps only HTTP plumbing): the default LLM seen as a text generator (`served`), the generation
parameters and their validation (TGI's checks; OpenAI checks its own ranges and words its own errors
first), the chat request body, admission, body decoding, timing headers, grouping events into finished
sequences, and the error shapes both protocols answer with. The limits are `lmiserve.core.limits`.

Modules: parameters, chat, validation, served, admission, body, timing, sequences, generation, wire,
errors, tools, reasoning.
"""
