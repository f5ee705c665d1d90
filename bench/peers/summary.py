"""The peers' table (docs/results/peers.md) from bench/peers/run.sh's outputs: for each peer,
rank count and timing, the peer's median time per size and gradcomm's ratio to it measured in the
same launch (gradcomm / peer, in time: below 1, gradcomm is faster). usage: summary.py RESULTS_DIR"""
import re
import sys
from pathlib import Path

SIZES = ["8", "32", "128", "512", "2K", "8K", "32K", "128K", "512K", "2M", "8M", "32M"]


def human(n):
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def section(line):
    """run.sh's "-- N ranks back to back|--cycle" line as (N, "b2b"|"cycle"), else None."""
    m = re.match(r"-- (\d+) ranks (back to back|--cycle)", line)
    return (int(m.group(1)), "b2b" if m.group(2) == "back to back" else "cycle") if m else None


def mpi_peer(text):
    """gradcomm-bench output: {(ranks, timing): {bytes: (mpi_us, auto_us)}}."""
    out, key, header = {}, None, []
    for line in text.splitlines():
        if section(line):
            key = section(line)
            out.setdefault(key, {})
            continue
        if line.startswith("#") and "algorithm" in line and "size" in line:
            header = line.lstrip("#").split()
            continue
        f = line.split()
        if key and header and len(f) > 5 and f[0].isdigit() and f[4] in ("auto", "mpi"):
            col = header.index("cycle_us") if key[1] == "cycle" and "cycle_us" in header \
                else header.index("p50_us")
            mpi, auto = out[key].get(int(f[0]), (None, None))
            value = float(f[col])
            out[key][int(f[0])] = (value, auto) if f[4] == "mpi" else (mpi, value)
    return out


def ccl_peer(text):
    """ccl_bench output: {(ranks, timing): {bytes: (oneccl_us, gradcomm_us)}}."""
    out, ranks = {}, None
    for line in text.splitlines():
        m = re.search(r"beside gradcomm \(auto\), (\d+) ranks", line)
        if m:
            ranks = int(m.group(1))
        m = re.match(r"\s*(\d+)\s+(b2b|cycle)\s+([\d.]+)\s+\[[^]]*\]\s+([\d.]+)", line)
        if ranks and m:
            out.setdefault((ranks, m.group(2)), {})[int(m.group(1))] = (float(m.group(3)),
                                                                        float(m.group(4)))
    return out


def gloo_peer(text):
    """bench/torch_allreduce_bench.py output: per size, gloo's and the gradcomm backend's
    medians (both through torch.distributed.all_reduce)."""
    out, key = {}, None
    for line in text.splitlines():
        if section(line):
            key = section(line)
            out.setdefault(key, {})
            continue
        m = re.match(r"\s*(\d+) B\s+gloo\s+([\d.]+) us.*?\sgradcomm\s+([\d.]+) us", line)
        if key and m:
            out[key][int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return out


def main(directory):
    d = Path(directory)
    peers = {}
    for name in ("openmpi4", "openmpi5", "mpich4", "mpich5", "impi", "oneccl", "gloo"):
        f = d / f"{name}.txt"
        if not f.exists():
            continue
        text = f.read_text()
        first = text.splitlines()[0] if text else ""
        if "could not" in first:
            print(f"- {name}: {first.lstrip('= ')}")
            continue
        parse = ccl_peer if name == "oneccl" else gloo_peer if name == "gloo" else mpi_peer
        peers[name] = (first.lstrip("= "), parse(text))
    for name, (settings, data) in peers.items():
        print(f"\n**{settings}**\n")
        keys = sorted(data)
        print("| bytes | " + " | ".join(f"{r} ranks {t}: peer, gradcomm/peer" for r, t in keys)
              + " |")
        print("| --- |" + " --- |" * len(keys))
        sizes = sorted({s for k in keys for s in data[k]})
        for s in sizes:
            cells = []
            for k in keys:
                peer, ours = data[k].get(s, (None, None))
                cells.append(f"{peer:.1f} us, **{ours / peer:.2f}**" if peer and ours else "")
            print(f"| {human(s)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/peers")
