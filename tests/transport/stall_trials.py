#!/usr/bin/env python3
"""A rank SIGSTOPped in the middle of a collective: trials, on every transport.

Each trial starts WORLD (3) ranks of ringzero-perf as a cluster user would, with torchrun-style
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables and no launcher, or under ringzero-run
(--run), running an all_reduce of SIZE bytes in a long loop with RINGZERO_TIMEOUT=TIMEOUT over
the trial's transport (they rotate: libfabric tcp;ofi_rxm, ringzero's socket transport, the
native shm transport; --transports picks), waits until the loop runs, sleeps a random moment
and SIGSTOPs one rank (rank 1 unless --victim says otherwise). A stopped process is alive and
holds its connections open, so nothing tells the others it failed but the deadline. The trial
then asserts, for every survivor:
  - it exits within BOUND seconds of its wait giving up (the deadline passing, which it logs at
    RINGZERO_DEBUG=INFO), and within TIMEOUT + 3 + BOUND seconds of the stop (a call begun
    after the stop has its deadline later), with a non-zero status and not by a signal (abandoned receives from the stopped peer were each drained
    for another timeout, rank 0's store waited a timeout for the stopped rank to close it, and
    closing the endpoint with a rendezvous to the stopped peer under way could crash inside
    ofi_rxm);
  - its error names the stopped rank ("rank R is stopped"), whichever rank it waited for;
and under ringzero-run, that the launcher names the stopped rank too, ends it, and exits
non-zero within the same bound. Without a launcher the stopped rank is killed afterwards.

usage: stall_trials.py RINGZERO_PERF [--run RINGZERO_RUN] [--transports LIST] [--trials N]
                       [--seed N] [--timeout S] [--bound S] [--size BYTES] [--victim R]
                       [--logs DIR]
Environment: RINGZERO_STALL_TRIALS (default 4: the socket transport without a launcher,
tcp;ofi_rxm under ringzero-run, native shm without, sockets under ringzero-run),
RINGZERO_STALL_SEED.
Prints one line per trial (for each survivor: when its wait gave up, when its error appeared
and when it exited, seconds after the stop) and a summary.
"""
import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

WORLD = 3
SLACK_S = 3  # a call that began after the stop: its deadline comes later
# Logged (RINGZERO_DEBUG=INFO) the moment a rank's deadline passes, before its teardown.
GAVE_UP = "pending operations when a wait gave up"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def error_line(text, rank):
    for line in text.splitlines():
        if line.startswith(f"ringzero-perf: rank {rank}:"):
            return line
    return None


def names(text, victim):
    v = str(victim)
    return re.search(rf"rank {v} is stopped", text) is not None


# How ringzero-perf selects each transport, and the line each rank logs once it is set up.
TRANSPORTS = {
    "tcp;ofi_rxm": (["-T", "libfabric", "-p", "tcp;ofi_rxm"], "libfabric: rank {r} of {n}\\b"),
    "socket": (["-T", "socket"], "socket: rank {r} of {n}\\b"),
    "shm": (["-T", "shm"], "shm: rank {r} of {n}\\b"),
}


def rank_pids(launcher_pid):
    """The ranks ringzero-run started, by RANK: its children, read from /proc."""
    pids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            pids[int(env[b"RANK"])] = int(d)
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return pids


class _Watched:
    """A process this script did not start (a rank of ringzero-run), as Popen's poll sees it."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is not None:
            return self.returncode
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state not in ("Z", "X"):
                return None
        except (OSError, IndexError):
            pass
        # Its status went to the launcher; a survivor's error line is what this script checks.
        self.returncode = 1
        return self.returncode

    def wait(self):
        while self.poll() is None:
            time.sleep(0.01)
        return self.returncode


def trial(perf, rng, tmp, idx, a):
    victim = a.victim if a.victim >= 0 else rng.randrange(WORLD)
    delay = rng.uniform(0.5, 1.5)
    transports = a.transports.split(",")
    transport = transports[idx % len(transports)]
    under_launcher = a.run is not None and idx % 2 == 1
    flags, ready = TRANSPORTS[transport]
    env = dict(os.environ, RINGZERO_TIMEOUT=f"{a.timeout:g}", RINGZERO_DEBUG="INFO",
               FI_PROVIDER="tcp;ofi_rxm")
    args = [perf, "all_reduce", *flags, "-b", a.size, "-e", a.size, "-n", "100000000", "-w", "0",
            "-c", "0"]
    logs = [os.path.join(tmp, f"t{idx}_r{r}.txt") for r in range(WORLD)]
    launcher_log = os.path.join(tmp, f"t{idx}_launcher.txt")
    procs = []
    launcher = None
    if under_launcher:
        # Each rank's lines go to its own file (--redirect); the launcher's own to launcher_log.
        with open(launcher_log, "w") as out:
            launcher = subprocess.Popen(
                [a.run, "-n", str(WORLD), "--redirect", os.path.join(tmp, f"t{idx}_ranks"), "--",
                 *args], env=env, stdout=out, stderr=subprocess.STDOUT)
        logs = [os.path.join(tmp, f"t{idx}_ranks", f"rank{r}.log") for r in range(WORLD)]
    else:
        port = free_port()
        for r in range(WORLD):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(WORLD))
            with open(logs[r], "w") as out:
                procs.append(subprocess.Popen(args, env=e, stdout=out, stderr=subprocess.STDOUT))
    result = {"victim": victim, "ok": True, "why": [], "gave_up_at": {}, "error_at": {},
              "exit_at": {}, "status": {}, "transport": transport,
              "launcher": "ringzero-run" if under_launcher else "none"}
    want = [re.compile(ready.format(r=r, n=WORLD)) for r in range(WORLD)]
    deadline = time.monotonic() + 60
    started = False
    while time.monotonic() < deadline and not started:
        text = "".join(read(p) for p in logs)
        started = all(w.search(text) for w in want)
        if any(p.poll() is not None for p in procs) or (launcher and launcher.poll() is not None):
            break
        time.sleep(0.02)
    if under_launcher and started:
        pids = rank_pids(launcher.pid)
        started = len(pids) == WORLD
        # Stand-ins that report the ranks' ends as seen through /proc (not our children).
        procs = [_Watched(pids.get(r, -1)) for r in range(WORLD)]
    if not started:
        result["ok"] = False
        result["why"].append("ranks did not start: " + " | ".join(
            read(p).strip().splitlines()[-1:][0] if read(p).strip() else "" for p in logs))
    else:
        time.sleep(delay)
        os.kill(procs[victim].pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    # A survivor may begin its next call after the stop, and its deadline counts from there.
    limit = a.timeout + SLACK_S + a.bound
    survivors = [r for r in range(WORLD) if r != victim]
    # Poll the survivors' logs and processes until all have exited or well past the limit.
    hard = stopped_at + limit + max(10.0, 2 * a.timeout)
    while started and time.monotonic() < hard:
        now = time.monotonic() - stopped_at
        for r in survivors:
            if r not in result["gave_up_at"] and GAVE_UP in read(logs[r]):
                result["gave_up_at"][r] = now
            if r not in result["error_at"] and error_line(read(logs[r]), r):
                result["error_at"][r] = now
            if r not in result["exit_at"] and procs[r].poll() is not None:
                result["exit_at"][r] = now
        if all(r in result["exit_at"] for r in survivors):
            break
        time.sleep(0.01)
    launcher_exit = None
    if launcher is not None:
        try:
            launcher_exit = launcher.wait(timeout=max(0.1, hard - time.monotonic()))
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except OSError:
                pass
        p.wait()
    if not started:
        return result
    if launcher is not None:
        said = read(launcher_log)
        if launcher_exit is None or launcher_exit == 0:
            result["ok"] = False
            result["why"].append(f"ringzero-run exited {launcher_exit} (still running, or 0)")
        if f"rank {victim} (pid" not in said or "is stopped" not in said:
            result["ok"] = False
            result["why"].append("ringzero-run did not name the stopped rank: "
                                 + " | ".join(said.strip().splitlines()[-3:]))
        if procs[victim].poll() is None:
            result["ok"] = False
            result["why"].append("ringzero-run left the stopped rank running")
    for r in survivors:
        text = read(logs[r])
        line = error_line(text, r)
        rc = procs[r].returncode
        result["status"][r] = rc
        if r not in result["exit_at"]:
            result["ok"] = False
            result["why"].append(f"rank {r} still running {hard - stopped_at:.0f} s after the stop")
            continue
        gave_up = result["gave_up_at"].get(r, result["error_at"].get(r))
        if gave_up is not None and result["exit_at"][r] - gave_up > a.bound:
            result["ok"] = False
            result["late"] = result.get("late", 0) + 1
            result["why"].append(f"rank {r} exited {result['exit_at'][r] - gave_up:.2f} s after its "
                                 f"wait gave up, past {a.bound:g} s")
        if result["exit_at"][r] > limit:
            result["ok"] = False
            result["why"].append(f"rank {r} exited {result['exit_at'][r]:.2f} s after the stop, "
                                 f"past {a.timeout:g} + {SLACK_S:g} + {a.bound:g} s")
        crash = re.search(r"terminated with signal (\d+)|Segmentation fault", text)
        if launcher is not None:
            rc = None if crash else 1  # its status went to the launcher, which checks it
        if (rc is None or rc < 0 or crash) and (launcher is None or crash):
            result["ok"] = False
            result["crash"] = True
            result["why"].append(f"rank {r} was ended by a signal (status {rc}"
                                 + (f": {crash.group(0)})" if crash else ")"))
        elif rc == 0:
            result["ok"] = False
            result["why"].append(f"rank {r} exited 0")
        if line is None:
            # Under ringzero-run the first survivor's error stops the others, who may end
            # before their own wait gives up; one error naming the victim is required below.
            if launcher is None:
                result["ok"] = False
                tail = [l for l in text.splitlines() if "INFO" not in l][-2:]
                result["why"].append(f"rank {r} printed no error: {tail}")
        elif not names(line, victim):
            result["ok"] = False
            result["why"].append(f"rank {r} did not name rank {victim}: {line}")
    if launcher is not None and not any(error_line(read(logs[r]), r) for r in survivors):
        result["ok"] = False
        result["why"].append("no survivor printed an error")
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("perf")
    ap.add_argument("--run", help="ringzero-run: every other trial runs under it")
    ap.add_argument("--transports", default="socket,tcp;ofi_rxm,shm",
                    help="comma-separated, from: " + ", ".join(TRANSPORTS))
    ap.add_argument("--trials", type=int, default=int(os.environ.get("RINGZERO_STALL_TRIALS", 4)))
    ap.add_argument("--seed", type=int,
                    default=int(os.environ.get("RINGZERO_STALL_SEED", time.time_ns() % 100000)))
    ap.add_argument("--timeout", type=float, default=3.0, help="RINGZERO_TIMEOUT for the ranks")
    ap.add_argument("--bound", type=float, default=2.0,
                    help="seconds from a survivor's wait giving up to its exit")
    ap.add_argument("--size", default="64M", help="all_reduce size, as ringzero-perf's -b")
    ap.add_argument("--victim", type=int, default=1, help="the rank to stop; -1: a random one")
    ap.add_argument("--logs", help="keep each rank's output in this directory")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    print(f"stall trials: {a.trials} trials, {WORLD} ranks, over {a.transports}"
          + (" (every other trial under ringzero-run)" if a.run else "") + f", all_reduce {a.size}, "
          f"RINGZERO_TIMEOUT={a.timeout:g}, exit within {a.bound:g} s of a wait giving up, seed {a.seed} "
          f"(RINGZERO_STALL_SEED={a.seed} repeats them)", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="ringzero-stall-") as scratch:
        tmp = a.logs or scratch
        if a.logs:
            os.makedirs(a.logs, exist_ok=True)
        for i in range(a.trials):
            r = trial(a.perf, rng, tmp, i, a)
            results.append(r)
            times = ", ".join(
                f"rank {k}: gave up {r['gave_up_at'].get(k, float('nan')):.2f} s, error "
                f"{r['error_at'].get(k, float('nan')):.2f} s, exit "
                f"{r['exit_at'].get(k, float('nan')):.2f} s (status {r['status'].get(k)})"
                for k in sorted(set(r["error_at"]) | set(r["exit_at"])))
            print(f"trial {i:3d}: {r['transport']}, launcher {r['launcher']}, victim "
                  f"{r['victim']}: {'ok' if r['ok'] else 'FAILED'}; {times}"
                  + ("" if r["ok"] else " — " + "; ".join(r["why"])), flush=True)
    exits = [t for r in results for t in r["exit_at"].values()]
    failed = [r for r in results if not r["ok"]]
    crashes = sum(1 for r in results if r.get("crash"))
    late = sum(r.get("late", 0) for r in results)
    teardown = [r["exit_at"][k] - r["gave_up_at"][k] for r in results for k in r["exit_at"]
                if k in r["gave_up_at"]]
    print(f"summary: {len(results)} trials, {len(failed)} failed, {crashes} with a survivor ended "
          f"by a signal, {late} survivors past the bound; from a wait giving up to exit "
          + (f"{min(teardown):.2f}-{max(teardown):.2f} s" if teardown else "unknown")
          + "; survivors exited "
          + (f"{min(exits):.2f}-{max(exits):.2f} s after the stop" if exits else "never"))
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
