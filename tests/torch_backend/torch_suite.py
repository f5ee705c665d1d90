"""torch's own distributed tests (DistributedTest._DistTestBase) on the gradcomm backend.

torch tests its backends (gloo, nccl, mpi, ucc) with the test methods of
torch/testing/_internal/distributed/distributed_test.py, run in processes it spawns itself.
gradcomm takes its ranks from MPI, so here mpirun starts the ranks and each runs the same test
methods in turn, as torch's harness does in each spawned process: a process group of its own per
test (init_process_group("gradcomm") over a fresh file store, torch's timeout for that test),
the test method, then destroy_process_group. Every rank checks its own result, as in torch.

Two modes:
  python torch_suite.py --np 3 [--only a,b] [--skip-file F] --out DIR    (the driver)
  (under mpirun) python torch_suite.py --rank-mode DIR test_a test_b ...   (one launch)

The driver launches mpirun with the tests left, reads each rank's JSON lines, and when a launch
dies (a rank's crash or the watchdog's abort) or stalls (no record for --test-timeout seconds),
records the running test as crashed or hung and launches again from the next one. It prints a
summary and writes DIR/results.json.

torch's skip decorators decide at import, by backend name, what runs: "gradcomm" is declared as a
third-party backend ("plugin") that does DDP, subgroups and CUDA, as gloo does. Tests torch
restricts to gloo alone, nccl alone, or more GPUs than the machine has are skipped and counted as
such.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback

SKIP_PREFIX = "skip: "


def _prepare_torch_env(world_size, temp_dir):
    os.environ["BACKEND"] = "gradcomm"
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["TEMP_DIR"] = temp_dir
    from torch.testing._internal import common_distributed

    cases = common_distributed.DistTestCases
    for feature in ("ddp", "subgroup", "plugin", "gpu", "cuda"):
        cases.backend_feature[feature].add("gradcomm")
    from torch.testing._internal.distributed import distributed_test

    return distributed_test


def _test_names(distributed_test):
    base = distributed_test.DistributedTest._DistTestBase
    return sorted(name for name in dir(base) if name.startswith("test_"))


def _exit_reason(code, common_distributed):
    for skip in common_distributed.TEST_SKIPS.values():
        if skip.exit_code == code:
            return skip.message
    return None


def _mkdirs(path):
    for sub in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(path, sub), exist_ok=True)


def _wait_for_files(paths, seconds):
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def rank_mode(out_dir, names):
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    world_size = MPI.COMM_WORLD.Get_size()
    base = os.path.join(out_dir, "work")
    os.makedirs(base, exist_ok=True)
    distributed_test = _prepare_torch_env(world_size, base)
    import datetime
    import unittest

    import gradcomm.torch  # noqa: F401  (registers the backend)
    import torch.distributed as dist
    from torch.testing._internal import common_distributed, common_utils

    class Case(distributed_test.DistributedTest._DistTestBase, common_utils.TestCase):
        @property
        def init_method(self):
            return "file://" + self.file_name

        @property
        def world_size(self):
            return os.environ["WORLD_SIZE"]

        destroy_pg_upon_exit = False

    log = open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a", buffering=1)
    for name in names:
        work = os.path.join(base, name)
        _mkdirs(work)
        os.environ["TEMP_DIR"] = work
        distributed_test.Barrier.barrier_id = 0
        log.write(json.dumps({"test": name, "event": "start"}) + "\n")
        ready = [os.path.join(work, f"ready.{r}") for r in range(world_size)]
        open(ready[rank], "w").close()
        if not _wait_for_files(ready, 600):
            log.write(json.dumps({"test": name, "event": "lost peers"}) + "\n")
            sys.exit(3)
        case = Case(name)
        case.rank = rank
        case.file_name = os.path.join(work, "store")
        outcome, detail = "pass", ""
        start = time.monotonic()
        try:
            seconds = distributed_test.CUSTOM_PG_TIMEOUT.get(
                name, distributed_test.default_pg_timeout
            )
            dist.init_process_group(
                backend="gradcomm",
                init_method=case.init_method,
                world_size=world_size,
                rank=rank,
                timeout=datetime.timedelta(seconds=seconds),
            )
            case._barrier()
            common_utils.set_rng_seed()
            getattr(case, name)()
        except unittest.SkipTest as e:
            outcome, detail = "skip", str(e)
        except SystemExit as e:
            reason = _exit_reason(e.code, common_distributed)
            if reason is not None and e.code != 0:
                outcome, detail = "skip", reason
            elif e.code not in (0, None):
                outcome, detail = "fail", f"SystemExit({e.code})"
        except BaseException:  # noqa: B036  (a test's own failure, reported as such)
            outcome = "fail"
            detail = traceback.format_exc()[-3000:]
        seconds = time.monotonic() - start
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: B036
            detail += "\n(destroy_process_group: " + traceback.format_exc()[-500:] + ")"
        record = {"test": name, "event": "end", "outcome": outcome, "seconds": round(seconds, 2)}
        record["detail"] = detail
        log.write(json.dumps(record) + "\n")
        done = [os.path.join(work, f"done.{r}") for r in range(world_size)]
        open(done[rank], "w").close()
        if not _wait_for_files(done, 600):
            sys.exit(3)
    log.close()


def _read_records(out_dir, world_size):
    records = {}
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                records.setdefault(rec["test"], {}).setdefault(r, []).append(rec)
    return records


def _verdict(per_rank, world_size):
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in per_rank.items()}
    if len(ends) < world_size or not all(ends.values()):
        return None
    outcomes = {r: e[-1]["outcome"] for r, e in ends.items()}
    if all(o == "skip" for o in outcomes.values()):
        return "skip", ends[0][-1]["detail"].splitlines()[0] if ends[0][-1]["detail"] else ""
    if all(o == "pass" for o in outcomes.values()):
        return "pass", ""
    failing = [r for r, o in outcomes.items() if o == "fail"]
    if failing:
        return "fail", f"rank {failing[0]}: " + ends[failing[0]][-1]["detail"]
    return "fail", "ranks disagree: " + json.dumps(outcomes)


def _headline(detail):
    """The exception's own line of a traceback (the last unindented one), else its last line."""
    lines = [ln for ln in detail.strip().splitlines() if ln.strip()]
    flush = [ln for ln in lines if not ln.startswith(" ") and not ln.startswith("Traceback")]
    return (flush or lines or [""])[-1][:240]


def driver(args):
    os.makedirs(args.out, exist_ok=True)
    names_py = [sys.executable, "-c", "import sys; sys.argv=['x']; "
                "from torch_suite import _prepare_torch_env, _test_names; "
                "print('\\n'.join(_test_names(_prepare_torch_env(2, '/tmp'))))"]
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    names = subprocess.run(names_py, env=env, check=True, capture_output=True, text=True)
    names = names.stdout.split()
    if args.only:
        wanted = args.only.split(",")
        names = [n for n in names if n in wanted]
    left = list(names)
    verdicts = {}
    launches = 0
    while left:
        launches += 1
        cmd = args.mpirun.split() + ["-np", str(args.np), sys.executable, "-u",
                                    os.path.abspath(__file__), "--rank-mode", args.out] + left
        with open(os.path.join(args.out, "launches.log"), "a") as launch_log:
            launch_log.write(f"== launch {launches}: {len(left)} tests from {left[0]}\n")
            launch_log.flush()
            proc = subprocess.Popen(cmd, stdout=launch_log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env)
            last_count, last_change = -1, time.monotonic()
            while proc.poll() is None:
                time.sleep(0.5)
                recs = _read_records(args.out, args.np)
                count = sum(len(v) for per in recs.values() for v in per.values())
                if count != last_count:
                    last_count, last_change = count, time.monotonic()
                elif time.monotonic() - last_change > args.test_timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
            rc = proc.returncode
        recs = _read_records(args.out, args.np)
        progressed = False
        while left:
            name = left[0]
            per = recs.get(name, {})
            verdict = _verdict(per, args.np)
            if verdict is not None:
                verdicts[name] = verdict
                left.pop(0)
                progressed = True
                continue
            if per:  # started, not finished on every rank
                how = "hung" if rc in (-signal.SIGKILL,) else f"launch ended with {rc}"
                verdicts[name] = ("fail", f"{how} during this test")
                left.pop(0)
                progressed = True
            break
        if not progressed and left:
            verdicts[left[0]] = ("fail", f"launch ended with {rc} before this test started")
            left.pop(0)
        print(f"[launch {launches}] {len(verdicts)}/{len(names)} done", flush=True)
    counts = {}
    for outcome, _ in verdicts.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"np": args.np, "counts": counts, "launches": launches,
                   "tests": {n: {"outcome": o, "detail": d} for n, (o, d) in verdicts.items()}},
                  f, indent=1)
    print(f"np {args.np}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for name, (outcome, detail) in verdicts.items():
        if outcome == "fail":
            print(f"FAIL {name}: {_headline(detail)}")
    return 0 if counts.get("fail", 0) == 0 else 1


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-mode":
        rank_mode(sys.argv[2], sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=3)
    parser.add_argument("--only", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--test-timeout", type=float, default=150)
    parser.add_argument("--mpirun", default="mpirun --oversubscribe")
    return driver(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
