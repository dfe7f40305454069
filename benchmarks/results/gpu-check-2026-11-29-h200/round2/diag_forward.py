"""pytest plugin: print the caller stack of every FastLlama.forward (why a step runs two forwards on CUDA)."""
import traceback


def pytest_configure(config):
    from lmiserve.engine.model.fast_llama import FastLlama

    real = FastLlama.forward

    def forward(self, step):
        stack = "".join(traceback.format_stack(limit=9)[:-1])
        print(f"FORWARD decode={len(step.decode_ids)} chunks={len(step.chunks)}\n{stack}", flush=True)
        return real(self, step)

    FastLlama.forward = forward
