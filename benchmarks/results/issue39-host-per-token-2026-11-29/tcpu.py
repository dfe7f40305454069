"""Per-thread CPU of the server per generated token over one bench run. usage: tcpu.py PORT [bench args...]"""
import os, re, subprocess, sys, urllib.request, json, time
port = int(sys.argv[1])
pid = int(subprocess.run(["pgrep", "-f", f"serve .*--port {port}"], capture_output=True, text=True).stdout.split()[0])
T = os.sysconf("SC_CLK_TCK")
def threads():
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            s = open(f"/proc/{pid}/task/{t}/stat").read()
        except FileNotFoundError:
            continue
        name = s[s.index("(") + 1:s.rindex(")")]
        f = s.rsplit(")", 1)[1].split()
        out[(t, name)] = (int(f[11]) + int(f[12])) / T
    return out
def tokens():
    text = urllib.request.urlopen(f"http://localhost:{port}/metrics").read().decode()
    m = re.search(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
a, t0 = threads(), tokens()
w0 = time.time()
r = subprocess.run([".venv/bin/lmiserve", "bench", "--url", f"http://localhost:{port}", "--skip-baselines", "--soak-requests", "0", *sys.argv[2:]], capture_output=True, text=True)
wall = time.time() - w0
b, t1 = threads(), tokens()
n = t1 - t0
tot = 0
rows = []
for k, v in b.items():
    d = v - a.get(k, 0.0)
    tot += d
    if d > 0.05:
        rows.append((d, k))
rows.sort(reverse=True)
print(f"tokens {n:.0f} wall {wall:.1f}s server cpu {tot:.2f}s = {1e6*tot/n:.1f} us/token")
for d, k in rows[:6]:
    print(f"  {k[1]+(' main' if int(k[0])==pid else ''):20s} {d:6.2f}s {1e6*d/n:6.1f} us/token")
for line in r.stdout.splitlines():
    if re.match(r"\s*(lmiserve|concurrency|\d)", line) or "tok/s" in line:
        print("  ", line)
