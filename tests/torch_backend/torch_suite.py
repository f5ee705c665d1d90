"""torch's own distributed tests (DistributedTest._DistTestBase) on the gradcomm backend.

torch tests its backends with the test methods of
torch/testing/_internal/distributed/distributed_test.py, each in processes it spawns itself.
gradcomm takes its ranks from MPI, so here mpirun starts the ranks and each runs the same test
methods in turn, as torch's harness does in each spawned process: a process group of its own per
test (init_process_group over a fresh file store, with torch's timeout for that test), the test
method, then destroy_process_group; the environment as it was before the test. Every rank checks
its own result, as in torch.

The tests decide by the backend's name what runs and which branch a test takes (decorators at
import, `if BACKEND == "gloo"` in the bodies), and only torch's own backends have branches. So
they see the name "gloo" and run as torch runs them on gloo, the CPU backend gradcomm replaces,
while every group they make is gradcomm's: init_process_group, new_group and new_subgroups asked
for gloo (or the default) get "gradcomm". Tests that check the backend's name, or that torch
keeps for gloo by name (monitored_barrier), fail by name alone. --backend gloo runs the same
list on gloo itself: the control, what fails on this machine whatever the backend (no GPU, no
torchvision). Tests for more GPUs or ranks than there are skip themselves, as in torch.

  python torch_suite.py --np 3 [--backend gloo] [--only a,b] [--expect F] --out DIR  (driver)
  (under mpirun) python torch_suite.py --rank-mode DIR BACKEND test_a test_b ...     (a launch)

The driver launches mpirun with the tests left, reads each rank's JSON lines, and when a launch
ends early (a rank's crash, the watchdog's abort) or stalls (no record for --test-timeout
seconds), records the running test as failed (how) and launches again from the next one. It
prints a summary and writes DIR/results.json. With --expect F (lines "test_name  why"), it fails
where a test fails that F does not list, and reports a listed test that passes.
"""

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback


def _prepare_torch_env(world_size, temp_dir):
    """What torch's distributed tests read at import; returns their module."""
    os.environ["BACKEND"] = "gloo"
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["TEMP_DIR"] = temp_dir
    from torch.testing._internal.distributed import distributed_test

    return distributed_test


def _test_names(distributed_test):
    base = distributed_test.DistributedTest._DistTestBase
    return sorted(name for name in dir(base) if name.startswith("test_"))


def _skip_reason(code, common_distributed):
    for skip in common_distributed.TEST_SKIPS.values():
        if skip.exit_code == code:
            return skip.message
    return None


def _wait_for_files(paths, seconds):
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _groups_are_gradcomms(dist):
    """init_process_group and new_group (new_subgroups calls it) asked for gloo, or for the
    default, make gradcomm groups."""
    from torch.distributed import distributed_c10d

    def mapped(backend):
        return "gradcomm" if backend is None or str(backend).lower() == "gloo" else backend

    init, new_group = distributed_c10d.init_process_group, distributed_c10d.new_group

    def init_process_group(*args, **kwargs):
        if args:
            args = (mapped(args[0]),) + args[1:]
        else:
            kwargs["backend"] = mapped(kwargs.get("backend"))
        return init(*args, **kwargs)

    def new_group_(*args, **kwargs):
        if len(args) >= 3:
            args = args[:2] + (mapped(args[2]),) + args[3:]
        else:
            kwargs["backend"] = mapped(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    for module in (dist, distributed_c10d):
        module.init_process_group = init_process_group
        module.new_group = new_group_


def _run_one(name, case, dist, distributed_test, common_distributed, common_utils, backend,
             rank, world_size):
    """Runs test `name` on this rank; returns (outcome, detail)."""
    import datetime
    import unittest

    try:
        seconds = distributed_test.CUSTOM_PG_TIMEOUT.get(name,
                                                         distributed_test.default_pg_timeout)
        dist.init_process_group(backend=backend, init_method=case.init_method,
                                world_size=world_size, rank=rank,
                                timeout=datetime.timedelta(seconds=seconds))
        case._barrier()
        common_utils.set_rng_seed()
        getattr(case, name)()
    except unittest.SkipTest as e:
        return "skip", str(e)
    except SystemExit as e:  # torch's GPU-count and world-size skips exit with a code
        reason = _skip_reason(e.code, common_distributed)
        if reason is not None and e.code != 0:
            return "skip", reason
        if e.code not in (0, None):
            return "fail", f"SystemExit({e.code})"
    except BaseException:  # noqa: B036  (the test's own failure, reported as such)
        return "fail", traceback.format_exc()[-3000:]
    return "pass", ""


def rank_mode(out_dir, backend, names):
    from mpi4py import MPI

    import gradcomm.torch  # noqa: F401  (registers the backend; MASTER_ADDR etc. from MPI)

    rank = MPI.COMM_WORLD.Get_rank()
    world_size = MPI.COMM_WORLD.Get_size()
    base = os.path.join(out_dir, "work")
    os.makedirs(base, exist_ok=True)
    distributed_test = _prepare_torch_env(world_size, base)
    import torch.distributed as dist
    from torch.testing._internal import common_distributed, common_utils

    if backend == "gradcomm":
        _groups_are_gradcomms(dist)

    class Case(distributed_test.DistributedTest._DistTestBase, common_utils.TestCase):
        destroy_pg_upon_exit = False

        @property
        def init_method(self):
            return "file://" + self.file_name

        @property
        def world_size(self):
            return os.environ["WORLD_SIZE"]

    log = open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a", buffering=1)
    for name in names:
        work = os.path.join(base, name)  # the test's TEMP_DIR: its barrier files and its store
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(work, sub), exist_ok=True)
        os.environ["TEMP_DIR"] = work
        distributed_test.Barrier.barrier_id = 0
        log.write(json.dumps({"test": name, "event": "start"}) + "\n")
        ready = [os.path.join(work, f"ready.{r}") for r in range(world_size)]
        open(ready[rank], "w").close()
        if not _wait_for_files(ready, 600):
            sys.exit(3)
        environ = dict(os.environ)  # torch runs each test in a process of its own
        case = Case(name)
        case.rank = rank
        case.file_name = os.path.join(work, "store")
        start = time.monotonic()
        outcome, detail = _run_one(name, case, dist, distributed_test, common_distributed,
                                   common_utils, backend, rank, world_size)
        seconds = time.monotonic() - start
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: B036
            detail += "\n(destroy_process_group: " + traceback.format_exc()[-500:] + ")"
        os.environ.clear()
        os.environ.update(environ)
        dist.set_debug_level_from_env()  # with_dist_debug_levels leaves DETAIL set
        log.write(json.dumps({"test": name, "event": "end", "outcome": outcome,
                              "seconds": round(seconds, 2), "detail": detail}) + "\n")
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
                    continue  # a line being written
                records.setdefault(rec["test"], {}).setdefault(r, []).append(rec)
    return records


def _verdict(per_rank, world_size):
    """(outcome, detail) once every rank finished the test, else None."""
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in per_rank.items()}
    if len(ends) < world_size or not all(ends.values()):
        return None
    outcomes = {r: e[-1]["outcome"] for r, e in ends.items()}
    if all(o == "skip" for o in outcomes.values()):
        return "skip", (ends[0][-1]["detail"].splitlines() or [""])[0]
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


def _launch(args, env, left, launches):
    """One mpirun over the tests `left`; returns its exit code (-9: stalled, killed)."""
    cmd = args.mpirun.split() + ["-np", str(args.np), sys.executable, "-u",
                                 os.path.abspath(__file__), "--rank-mode", args.out,
                                 args.backend] + left
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
                return -signal.SIGKILL
        return proc.returncode


def driver(args):
    os.makedirs(args.out, exist_ok=True)
    for stale in glob.glob(os.path.join(args.out, "rank*.jsonl")) + [
            os.path.join(args.out, "launches.log"), os.path.join(args.out, "results.json")]:
        if os.path.exists(stale):  # a previous run's
            os.remove(stale)
    shutil.rmtree(os.path.join(args.out, "work"), ignore_errors=True)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    names = subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv = ['x']; import torch_suite as s; "
         "print('\\n'.join(s._test_names(s._prepare_torch_env(2, '/tmp'))))"],
        env=env, check=True, capture_output=True, text=True).stdout.split()
    if args.only:
        wanted = set(args.only.split(","))
        names = [n for n in names if n in wanted]
    left, verdicts, launches = list(names), {}, 0
    while left:
        launches += 1
        rc = _launch(args, env, left, launches)
        recs = _read_records(args.out, args.np)
        progressed = False
        while left:
            per = recs.get(left[0], {})
            verdict = _verdict(per, args.np)
            if verdict is None and not per:
                break  # not started in this launch
            if verdict is None:  # started, not finished on every rank
                how = "stalled" if rc == -signal.SIGKILL else f"the launch ended with {rc}"
                verdict = ("fail", f"{how} during this test")
            verdicts[left.pop(0)] = verdict
            progressed = True
            if verdict[1].endswith("during this test"):
                break
        if not progressed:
            verdicts[left.pop(0)] = ("fail", f"the launch ended with {rc} before this test")
    counts = {}
    for outcome, _ in verdicts.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"np": args.np, "backend": args.backend, "counts": counts,
                   "launches": launches,
                   "tests": {n: {"outcome": o, "detail": d} for n, (o, d) in verdicts.items()}},
                  f, indent=1)
    print(f"torch's distributed tests on {args.backend}, {args.np} ranks: " +
          ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" ({launches} launches)")
    expected = {}
    if args.expect:
        with open(args.expect) as f:
            for line in f:
                if line.strip() and not line.startswith("#"):
                    name, _, why = line.strip().partition(" ")
                    expected[name] = why.strip()
    unexpected = 0
    for name, (outcome, detail) in verdicts.items():
        if outcome == "fail":
            known = name in expected
            unexpected += not known
            print(f"{'fail (expected)' if known else 'FAIL'} {name}: {_headline(detail)}")
        elif outcome == "pass" and name in expected:
            print(f"passes, though listed as failing: {name}")
    if args.expect:
        print(f"{unexpected} unexpected failures")
        return 1 if unexpected else 0
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-mode":
        rank_mode(sys.argv[2], sys.argv[3], sys.argv[4:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=3)
    parser.add_argument("--backend", choices=["gradcomm", "gloo"], default="gradcomm")
    parser.add_argument("--only", default="", help="comma-separated test names")
    parser.add_argument("--expect", default="", help="the tests expected to fail, and why")
    parser.add_argument("--out", required=True)
    parser.add_argument("--test-timeout", type=float, default=150)
    parser.add_argument("--mpirun", default="mpirun --oversubscribe")
    return driver(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
