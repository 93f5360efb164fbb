#!/usr/bin/env python3
"""A rank SIGKILLed in the middle of a collective: randomized trials over libfabric, shm and
sockets.

Each trial starts WORLD ranks of ringzero-perf running one collective in a long loop (over
libfabric's shm or tcp;ofi_rxm provider, the native shm transport or ringzero's socket
transport, one picked at random, so
the fixed budget is split across them), either
as a cluster user would (torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, nobody to
stop the others) or under ringzero-run, waits until the timed loop runs, sleeps a random
moment, and SIGKILLs a random rank. It then asserts:
  - every survivor exits (no hang) with a non-zero status within RINGZERO_TIMEOUT plus a
    margin, and its error names the killed rank as the one that failed (--culprit strict, the
    default; with report, a wrong or missing name is only counted and printed);
  - no survivor dies of a signal (a crash in its teardown, or in the provider's);
  - ringzero-run (when used) exits non-zero and names the killed rank;
  - no rank process is left, and no /dev/shm region of any rank is left.

usage: kill_trials.py RINGZERO_PERF RINGZERO_RUN [--trials N] [--budget S] [--seed N]
                     [--culprit strict|report] [--transport T]... [--collective C]...
                     [--launcher any|none|ringzero-run]
Environment: RINGZERO_KILL_TRIALS (trials, default 50), RINGZERO_KILL_BUDGET (seconds, default
170: the trials stop early, as a failure, if they would run past it), RINGZERO_KILL_SEED,
RINGZERO_KILL_CULPRIT (strict or report).
Prints one line per trial and a summary: trials, hangs, wrong culprit, survivors that crashed,
time from the kill until every rank is gone (median, max) by transport and launcher.
"""
import argparse
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]
# libfabric providers by name; "native shm" is ringzero-perf -T shm, "socket" -T socket.
TRANSPORTS = ["shm", "tcp;ofi_rxm", "native shm", "socket"]
TIMEOUT_S = 10  # RINGZERO_TIMEOUT for the ranks
MARGIN_S = 8  # beyond the timeout: the watchdog's grace and process teardown


STRICT_CULPRIT = True
LAUNCHER = "any"  # --launcher: any, none (torchrun-style) or ringzero-run


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_names():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def shm_entries(pids, before=frozenset()):
    # Names there before the trial are not its own: pids wrap (pid_max is often 32768), and a
    # name that another program left behind may carry the pid a rank of this trial got.
    names = shm_names() - before
    # libfabric's providers name theirs <pid>:...; the native shm transport /ringzero-<pid>-...
    return [n for n in names for p in pids
            if n.startswith(f"{p}:") or n.startswith(f"ringzero-{p}-")]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def children_of(ppid):
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == ppid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return out


def culprit_named(text, victim):
    v = str(victim)
    pats = [
        rf"rank {v} died",
        rf"rank {v} has died",
        rf"rank {v} is unreachable",
        rf"(to|from) rank {v} failed",
        rf"rank {v} \(pid \d+\) was killed by signal 9",
        rf"rank {v} \(pid \d+\) is gone",
        # The socket transport: the victim's own connections, or a survivor that closed its
        # transport after it (the error's culprit is the victim either way).
        rf"rank {v} is gone: its (connection|last rail)",
        rf"closed its transport after rank {v} failed",
    ]
    return any(re.search(p, text) for p in pats)


def wait_started(paths, world, deadline, transport):
    # Each rank logs "libfabric: rank R of N", "shm: rank R of N" or "socket: rank R of N"
    # (RINGZERO_DEBUG=INFO, unbuffered stderr) once its communicator is up; the collective loop
    # starts right after.
    what = {"native shm": "shm", "socket": "socket"}.get(transport, "libfabric")
    want = [re.compile(rf"{what}: rank {r} of {world}\b") for r in range(world)]
    while time.monotonic() < deadline:
        text = ""
        for path in paths:
            try:
                with open(path, errors="replace") as f:
                    text += f.read()
            except OSError:
                pass
        if all(w.search(text) for w in want):
            return True
        time.sleep(0.02)
    return False


def trial(perf, run, rng, tmp, idx):
    provider = rng.choice(TRANSPORTS)
    coll = rng.choice(COLLECTIVES)
    launcher = rng.random() < 0.5
    if LAUNCHER != "any":
        launcher = LAUNCHER == "ringzero-run"
    world = rng.choice([3, 4])
    victim = rng.randrange(world)
    size = rng.choice(["64K", "1M", "4M"])
    delay = rng.uniform(0.05, 0.4)
    env = dict(os.environ)
    env.update(RINGZERO_TIMEOUT=str(TIMEOUT_S), RINGZERO_DEBUG="INFO")
    args = [perf, coll, "-b", size, "-e", size, "-n", "100000000", "-w", "0", "-c", "0"]
    if provider in ("native shm", "socket"):
        args += ["-T", "shm" if provider == "native shm" else "socket"]
    else:
        args += ["-p", provider, "-T", "libfabric"]
    logs = [os.path.join(tmp, f"t{idx}_r{r}.txt") for r in range(world)]
    procs = []
    launcher_proc = None
    launcher_log = os.path.join(tmp, f"t{idx}_run.txt")
    shm_before = shm_names()
    started = time.monotonic()
    if launcher:
        with open(launcher_log, "w") as out:
            launcher_proc = subprocess.Popen([run, "-n", str(world), "--grace", "2", "--"] + args,
                                             env=env, stdout=out, stderr=subprocess.STDOUT)
        ok = wait_started([launcher_log], world, started + 30, provider)
        pids = []
        deadline = time.monotonic() + 5
        while len(pids) < world and time.monotonic() < deadline:
            pids = sorted(children_of(launcher_proc.pid))
            time.sleep(0.01)
        # Ranks are spawned in rank order, so pids sort in rank order unless they wrapped.
        rank_pid = {}
        for p in pids:
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    for kv in f.read().split(b"\0"):
                        if kv.startswith(b"RANK="):
                            rank_pid[int(kv[5:])] = p
            except OSError:
                pass
        pids = [rank_pid.get(r, -1) for r in range(world)]
    else:
        port = free_port()
        for r in range(world):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world))
            with open(logs[r], "w") as out:
                procs.append(subprocess.Popen(args, env=e, stdout=out, stderr=subprocess.STDOUT))
        ok = wait_started(logs, world, started + 30, provider)
        pids = [p.pid for p in procs]
    result = {"provider": provider, "coll": coll, "launcher": launcher, "world": world,
              "victim": victim, "ok": True, "why": [], "secs": 0.0}
    if not ok or -1 in pids:
        result["ok"] = False
        result["why"].append("ranks did not start")
    else:
        time.sleep(delay)
        os.kill(pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    limit = killed_at + TIMEOUT_S + MARGIN_S
    hung = False
    if launcher:
        try:
            launcher_proc.wait(timeout=max(0.1, limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
    else:
        for r, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
    result["secs"] = time.monotonic() - killed_at
    if hung:
        result["ok"] = False
        result["hang"] = True
        result["why"].append(f"still running {TIMEOUT_S + MARGIN_S} s after the kill")
    # Tear down whatever is left, so that one failed trial does not spoil the next.
    for p in pids:
        if p > 0 and alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    if launcher_proc is not None:
        if launcher_proc.poll() is None:
            launcher_proc.kill()
        launcher_proc.wait()
        text = open(launcher_log, errors="replace").read()
        if launcher_proc.returncode == 0:
            result["ok"] = False
            result["why"].append("ringzero-run exited 0")
        if not re.search(rf"ringzero-run: rank {victim} \(pid \d+\) was killed by signal 9", text):
            result["ok"] = False
            said = [l for l in text.splitlines() if l.startswith("ringzero-run:")]
            result["why"].append(f"ringzero-run did not name the killed rank: {said[:2]}")
        survivors = {r: "\n".join(l for l in text.splitlines() if l.startswith(f"[{r}] "))
                     for r in range(world) if r != victim}
    else:
        survivors = {}
        for r in range(world):
            if r == victim:
                continue
            survivors[r] = open(logs[r], errors="replace").read()
            rc = procs[r].returncode
            if rc == 0:
                result["ok"] = False
                result["why"].append(f"rank {r} exited 0")
    # A survivor that crashed fails the trial. libfabric's psm provider (libpsm_infinipath,
    # linked into libfabric on Debian) installs a handler for fatal signals that prints
    # "terminated with signal N ... Backtrace:" and exits 1, so the crash shows in the log, not
    # in the exit status; without that handler it is the exit status.
    for r, text in survivors.items():
        m = re.search(r"terminated with signal (\d+)", text)
        rc = None if launcher else procs[r].returncode
        # SIGKILL is the trial's own teardown of a survivor that hung (counted as a hang).
        if m or (rc is not None and rc < 0 and rc != -signal.SIGKILL):
            result["ok"] = False
            result["crash"] = True
            sig = m.group(1) if m else str(-rc)
            result["why"].append(f"rank {r} crashed with signal {sig}")
    if not launcher:
        # Under ringzero-run the launcher stops the survivors at once; its verdict names the
        # victim. Without it, every survivor must find the culprit itself.
        for r, text in survivors.items():
            if not culprit_named(text, victim):
                if STRICT_CULPRIT:
                    result["ok"] = False
                last = [l for l in text.splitlines() if "ringzero" in l and "INFO" not in l]
                result["why"].append(f"rank {r} did not name rank {victim}: {last[-6:]}")
                result["wrong"] = True
    time.sleep(0.05)
    left = [p for p in pids if p > 0 and alive(p)]
    if left:
        result["ok"] = False
        result["why"].append(f"processes left: {left}")
    regions = shm_entries([p for p in pids if p > 0], shm_before)
    if regions:
        result["ok"] = False
        result["why"].append(f"/dev/shm regions left: {regions}")
        for n in regions:
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except OSError:
                pass
    return result


def main():
    global STRICT_CULPRIT, LAUNCHER, TRANSPORTS, COLLECTIVES
    ap = argparse.ArgumentParser()
    ap.add_argument("perf")
    ap.add_argument("run")
    ap.add_argument("--trials", type=int, default=int(os.environ.get("RINGZERO_KILL_TRIALS", 50)))
    ap.add_argument("--budget", type=float,
                    default=float(os.environ.get("RINGZERO_KILL_BUDGET", 170)))
    ap.add_argument("--seed", type=int,
                    default=int(os.environ.get("RINGZERO_KILL_SEED", time.time_ns() % 100000)))
    ap.add_argument("--culprit", choices=("strict", "report"),
                    default=os.environ.get("RINGZERO_KILL_CULPRIT", "strict"),
                    help="strict (default): a survivor that names another rank fails the trial; "
                         "report: such trials are counted and printed")
    ap.add_argument("--transport", choices=TRANSPORTS, action="append",
                    help="draw only from these transports (repeatable; default: all)")
    ap.add_argument("--collective", choices=COLLECTIVES, action="append",
                    help="draw only from these collectives (repeatable; default: all)")
    ap.add_argument("--launcher", choices=("any", "none", "ringzero-run"), default="any",
                    help="none: torchrun-style ranks only; ringzero-run: under the launcher only")
    a = ap.parse_args()
    STRICT_CULPRIT = a.culprit == "strict"
    LAUNCHER = a.launcher
    TRANSPORTS = a.transport or TRANSPORTS
    COLLECTIVES = a.collective or COLLECTIVES
    rng = random.Random(a.seed)
    print(f"kill trials: {a.trials} trials, budget {a.budget:g} s, seed {a.seed} "
          f"(RINGZERO_KILL_SEED={a.seed} repeats them)", flush=True)
    begin = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="ringzero-kill-") as tmp:
        for i in range(a.trials):
            if time.monotonic() - begin > a.budget:
                print(f"budget of {a.budget:g} s spent after {i} trials", flush=True)
                break
            r = trial(a.perf, a.run, rng, tmp, i)
            results.append(r)
            print(f"trial {i:3d}: {r['provider']:11s} {r['coll']:14s} "
                  f"{'ringzero-run' if r['launcher'] else 'torchrun-env':12s} world {r['world']} "
                  f"victim {r['victim']}: {'ok' if r['ok'] else 'FAILED'} in {r['secs']:.2f} s"
                  + ("" if r["ok"] and not r.get("wrong") and not r.get("crash")
                     else " — " + "; ".join(r["why"])),
                  flush=True)
    failed = [r for r in results if not r["ok"]]
    hangs = sum(1 for r in results if r.get("hang"))
    wrong = sum(1 for r in results if r.get("wrong"))
    crashes = sum(1 for r in results if r.get("crash"))
    print(f"summary: {len(results)} trials, {len(failed)} failed, {hangs} hangs, "
          f"{wrong} wrong or missing culprit, {crashes} survivor crashes, "
          f"{time.monotonic() - begin:.0f} s")
    for prov in TRANSPORTS:
        for launcher in (False, True):
            ts = [r["secs"] for r in results if r["provider"] == prov and r["launcher"] == launcher]
            if ts:
                print(f"  {prov:11s} {'ringzero-run' if launcher else 'torchrun-env':12s} "
                      f"{len(ts):3d} trials, time from kill to every rank gone: median "
                      f"{statistics.median(ts):.2f} s, max {max(ts):.2f} s")
    minimum = min(a.trials, 50)
    if len(results) < minimum:
        print(f"only {len(results)} of the {minimum} trials required ran within the budget")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
