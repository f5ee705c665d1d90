import sys,csv,glob,statistics as st,collections,re
d=collections.defaultdict(list)
for f in glob.glob((sys.argv[1] if len(sys.argv) > 1 else 'csv') + '/*.csv'):
    m=re.match(r'.*/(\w+)_v(\d)_r(\d+)\.csv',f); mode,v,r=m.group(1),int(m.group(2)),int(m.group(3))
    for row in csv.DictReader(open(f)):
        if row['algorithm']=='shm': d[(mode,int(row['size']),r,v)]=float(row['p50_us'])
modes=sorted(set(k[0] for k in d)); sizes=sorted(set(k[1] for k in d)); rounds=sorted(set(k[2] for k in d))
for mode in modes:
  for s in sizes:
    base=[d[(mode,s,r,0)] for r in rounds if (mode,s,r,0) in d and (mode,s,r,2) in d]
    out=f"{mode:20s} {s>>20:3d} MiB v0 {st.median(base):8.1f} us"
    for v in (1,2):
      rat=[d[(mode,s,r,v)]/d[(mode,s,r,0)] for r in rounds if (mode,s,r,v) in d and (mode,s,r,0) in d]
      out+=f"  v{v}/v0 med {st.median(rat):.3f} ({min(rat):.2f}-{max(rat):.2f}, faster in {sum(x<1 for x in rat)}/{len(rat)})"
    print(out)
