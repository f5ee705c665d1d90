import sys, statistics as st
from collections import defaultdict
r=defaultdict(list); a=defaultdict(list); m=defaultdict(list); picks=defaultdict(set)
t=None
for line in open(sys.argv[1]):
    if line.startswith('==='): t=line.split()[-1]; continue
    p=line.split()
    if len(p)==4 and t:
        s=int(p[0]); r[(t,s)].append(float(p[1])/float(p[2])); a[(t,s)].append(float(p[1])); m[(t,s)].append(float(p[2])); picks[(t,s)].add(p[3])
for k in sorted(r):
    print(k, f"ratio med {st.median(r[k]):.2f} ({min(r[k]):.2f}-{max(r[k]):.2f}) gradcomm {st.median(a[k]):.2f} ({min(a[k]):.2f}-{max(a[k]):.2f}) impi {st.median(m[k]):.2f} ({min(m[k]):.2f}-{max(m[k]):.2f})", picks[k])
