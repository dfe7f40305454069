import sys, collections, re
path = sys.argv[1]; top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
threads = collections.Counter(); incl = collections.defaultdict(collections.Counter); selff = collections.defaultdict(collections.Counter)
for line in open(path):
    stack, n = line.rstrip().rsplit(" ", 1); n = int(n)
    frames = stack.split(";")
    th = frames[0]; threads[th] += n
    seen = set()
    for f in frames[1:]:
        key = re.sub(r":\d+\)$", ")", f)
        if key not in seen:
            incl[th][key] += n; seen.add(key)
    selff[th][re.sub(r":\d+\)$", ")", frames[-1])] += n
for th, tot in threads.most_common():
    print(f"== {th} {tot}")
    if tot < 50: continue
    print(" -- inclusive")
    for k, v in incl[th].most_common(top): print(f"  {100*v/tot:5.1f}% {k[:150]}")
    print(" -- self")
    for k, v in selff[th].most_common(25): print(f"  {100*v/tot:5.1f}% {k[:150]}")
