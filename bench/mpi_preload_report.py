"""Tables for docs/results/mpi-preload.md from bench/mpi_preload_report.sh's CSV files.

Per size and rank count: the median over repetitions of each run's median time, for Open MPI's
MPI_Allreduce (plain), the same program with libgradcomm_mpi.so preloaded, and gradcomm-bench's
auto; then per-repetition ratios (runs of one repetition were made one after the other), as the
median and range over repetitions.
usage: mpi_preload_report.py DIR
"""
import csv
import glob
import os
import re
import statistics
import sys
from collections import defaultdict


def load(directory):
    # runs[(kind, np)][rep][bytes] = median us
    runs = defaultdict(lambda: defaultdict(dict))
    for path in glob.glob(os.path.join(directory, "*.csv")):
        m = re.match(r"(plain|preload|native|plaindefault|plaincycle|preloadcycle)_np(\d+)"
                     r"_rep(\d+)\.csv",
                     os.path.basename(path))
        if not m:
            continue
        kind, np_, rep = m.group(1), int(m.group(2)), int(m.group(3))
        with open(path) as f:
            rows = [line for line in f if not line.startswith("#")]
        for row in csv.DictReader(rows):
            if kind == "native":
                if row["algorithm"] != "auto":
                    continue
                runs[(kind, np_)][rep][int(row["size"])] = float(row["p50_us"])
            elif kind.endswith("cycle"):
                runs[(kind, np_)][rep][int(row["bytes"])] = (float(row["median_us"]),
                                                            float(row["cycle_median_us"]))
            else:
                runs[(kind, np_)][rep][int(row["bytes"])] = float(row["median_us"])
    return runs


def size_name(b):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b // scale} {unit}"
    return f"{b} B"


def ratio_text(values):
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main():
    runs = load(sys.argv[1])
    for np_ in sorted({k[1] for k in runs}):
        plain, pre, native = runs[("plain", np_)], runs[("preload", np_)], runs[("native", np_)]
        default = runs.get(("plaindefault", np_), {})
        reps = sorted(set(plain) & set(pre) & set(native))
        if not reps:
            continue
        sizes = sorted(set.intersection(*(set(plain[r]) for r in reps)))
        print(f"\n### {np_} ranks ({len(reps)} repetitions; us: median over repetitions)\n")
        header = ("| size | Open MPI | preloaded | gradcomm-bench auto | preloaded / auto "
                  "| Open MPI / preloaded |")
        if default:
            header += " Open MPI, default malloc / preloaded |"
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for b in sizes:
            med = lambda run: statistics.median(run[r][b] for r in reps if b in run[r])
            pre_vs_native = [pre[r][b] / native[r][b] for r in reps if b in native[r]]
            speedup = [plain[r][b] / pre[r][b] for r in reps]
            line = (f"| {size_name(b)} | {med(plain):.1f} | {med(pre):.1f} | {med(native):.1f} "
                    f"| {ratio_text(pre_vs_native)} | {ratio_text(speedup)} |")
            if default:
                d = [default[r][b] / pre[r][b] for r in reps if r in default and b in default[r]]
                line += f" {ratio_text(d)} |"
            print(line)
        cplain, cpre = runs.get(("plaincycle", np_), {}), runs.get(("preloadcycle", np_), {})
        creps = sorted(set(cplain) & set(cpre))
        if not creps:
            continue
        print(f"\n#### {np_} ranks, training-like cycle (inputs rewritten, results read; "
              f"{len(creps)} repetitions)\n")
        print("| size | Open MPI call | preloaded call | Open MPI / preloaded, call "
              "| Open MPI / preloaded, whole cycle |")
        print("|---|---|---|---|---|")
        for b in sorted(set.intersection(*(set(cplain[r]) for r in creps))):
            call = [cplain[r][b][0] / cpre[r][b][0] for r in creps]
            cycle = [cplain[r][b][1] / cpre[r][b][1] for r in creps]
            print(f"| {size_name(b)} | {statistics.median(cplain[r][b][0] for r in creps):.1f} "
                  f"| {statistics.median(cpre[r][b][0] for r in creps):.1f} "
                  f"| {ratio_text(call)} | {ratio_text(cycle)} |")


if __name__ == "__main__":
    main()
