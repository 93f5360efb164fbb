#!/usr/bin/env python3
"""The CPU each test of a CTest selection takes: user + sys of its whole process tree.

Runs the tests CTest would run (same commands, environment and working directory, taken from
`ctest --show-only=json-v1`), two at a time by default as the suite runs them, and prints the
total and the most expensive tests. docs/testing.md quotes its figures.

  python3 scripts/test_cpu.py BUILD_DIR [--jobs N] [--top N] [CTEST SELECTION ARGS...]
  e.g. RINGZERO_WAIT_MODE=sleep python3 scripts/test_cpu.py build/ci -LE unit
"""
import argparse
import json
import os
import subprocess
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    a, selection = ap.parse_known_args()
    info = json.loads(subprocess.check_output(
        ["ctest", "--test-dir", a.build, "--show-only=json-v1"] + selection))
    tests = []
    for t in info["tests"]:
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        if props.get("DISABLED"):
            continue
        env = dict(os.environ)
        for kv in props.get("ENVIRONMENT", []):
            k, v = kv.split("=", 1)
            env[k] = v
        tests.append((t["name"], t["command"], props.get("WORKING_DIRECTORY", a.build), env))
    running, results = {}, []
    while tests or running:
        while tests and len(running) < a.jobs:
            name, cmd, cwd, env = tests.pop(0)
            p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
            running[p.pid] = (name, time.monotonic())
        # wait4's resource use covers the test and every descendant it waited for.
        pid, status, use = os.wait4(-1, 0)
        if pid in running:
            name, began = running.pop(pid)
            results.append((use.ru_utime + use.ru_stime, time.monotonic() - began, name,
                            os.waitstatus_to_exitcode(status)))
    results.sort(reverse=True)
    print(f"total cpu {sum(r[0] for r in results):.1f} s over {len(results)} tests")
    for cpu, wall, name, rc in results[:a.top]:
        print(f"{cpu:7.1f} cpu {wall:7.1f} wall rc={rc} {name}")


if __name__ == "__main__":
    main()
