"""`lmiserve bench`: a serving benchmark (closed-loop streaming clients against lmiserve and any
OpenAI-compatible server, plus the bare model forward and `model.generate` in process).

Modules: cli (arguments), runner (one run), clients (LMI and OpenAI streaming dialects, closed
loop), server (the started server and its RSS), stats (per-level figures), report (JSON, targets,
table), chart (PNG), baselines (torch; the only module here that imports it), prompts.
"""
