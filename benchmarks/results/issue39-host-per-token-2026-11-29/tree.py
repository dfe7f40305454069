import sys, collections, re
path, root = sys.argv[1], sys.argv[2]; depth = int(sys.argv[3]) if len(sys.argv) > 3 else 6; thr = sys.argv[4] if len(sys.argv) > 4 else "MainThread"
tree = collections.Counter(); total = 0
for line in open(path):
    stack, n = line.rstrip().rsplit(" ", 1); n = int(n)
    frames = [re.sub(r" \(.*?([^/]+\.py).*\)$", r" (\1)", f) for f in stack.split(";")]
    if thr not in frames[0]: continue
    total += n
    try: i = next(j for j, f in enumerate(frames) if f.startswith(root))
    except StopIteration: continue
    sub = frames[i:i + depth]
    for d in range(1, len(sub) + 1): tree[tuple(sub[:d])] += n
def show(prefix, ind):
    kids = sorted([(v, k) for k, v in tree.items() if len(k) == len(prefix) + 1 and k[:len(prefix)] == prefix], reverse=True)
    for v, k in kids:
        if 100 * v / total < 0.6: continue
        print(f"{'  '*ind}{100*v/total:5.1f}% {k[-1]}")
        show(k, ind + 1)
show((), 0)
