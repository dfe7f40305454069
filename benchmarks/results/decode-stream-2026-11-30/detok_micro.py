"""IncrementalDetokenizer.add a token, through HfTokenizer (what the engine's Sequence does), best of 7."""
import sys, time, os, tempfile, pathlib
from transformers import AutoTokenizer
from lmiserve.engine.text.tokenizer import HfTokenizer
from lmiserve.engine.text.detokenizer import IncrementalDetokenizer
path = sys.argv[1]; kw = {}
if path.endswith(".gguf"):
    kw = dict(gguf_file=os.path.basename(path)); path = os.path.dirname(path)
tok = HfTokenizer(AutoTokenizer.from_pretrained(path, **kw))
text = open("/work/main/README.md").read() + open("/work/main/docs/engine.md").read()
ids = tok.encode(text)[:2100]
prompt, gen = ids[:20], ids[20:2020]
best = 1e9
for _ in range(7):
    t = time.perf_counter()
    d = IncrementalDetokenizer(tok, prompt, True)
    out = [d.add(i) for i in gen]
    out.append(d.flush())
    best = min(best, time.perf_counter() - t)
print(f"{sys.argv[2]} {os.path.basename(sys.argv[1])}: {best / len(gen) * 1e6:.2f} us a token, stream={getattr(d, '_stream', None) is not None}")
