#!/usr/bin/env python3
"""Checks that every code block in docs/*.md is code the test suite builds.

A fenced block is accepted when it is
  - shell or output: its info string is sh, bash, shell, console or text; or
  - extracted: the line before the fence is
        <!-- example: PATH -->          (the whole file, less docs-begin/docs-end lines)
        <!-- example: PATH#NAME -->     (the lines between "docs-begin: NAME" and
                                         "docs-end: NAME" in PATH, dedented)
    and the block's text equals that file or region. PATH is relative to the repository root;
    the programs it names are compiled and run by tests/package (docs.* and package.* tests).

Usage: check_docs.py [--root DIR] [FILE.md ...]   (default: every docs/*.md)
Prints one line per problem, file:line first, and exits 1 if there is any.
"""
import argparse
import pathlib
import re
import sys
import textwrap

SHELL_OR_OUTPUT = {"sh", "bash", "shell", "console", "text"}
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^<!--\s*example:\s*(?P<path>[^#\s]+)(?:#(?P<region>[\w.-]+))?\s*-->$")
REGION_LINE = re.compile(r"(?://|#)\s*docs-(?P<kind>begin|end):\s*(?P<name>[\w.-]+)\s*$")


def blocks(text):
    """Yields (line number of the opening fence, info string, body, previous non-blank line)."""
    lines = text.split("\n")
    i = 0
    previous = ""
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        fence = m.group("fence")
        start = i
        body = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence[0] * len(fence)) and not lines[i].strip().strip(fence[0])
        ):
            body.append(lines[i])
            i += 1
        yield start + 1, m.group("info").strip(), "\n".join(body), previous
        previous = ""
        i += 1


def normalize(text):
    return "\n".join(line.rstrip() for line in text.strip("\n").split("\n"))


def extract(root, path, region):
    """The text a marker names, or raises ValueError saying why there is none."""
    source = root / path
    if not source.is_file():
        raise ValueError(f"{path} does not exist")
    lines = source.read_text().split("\n")
    if region is None:
        return "\n".join(line for line in lines if not REGION_LINE.search(line))
    inside = False
    picked = []
    for line in lines:
        m = REGION_LINE.search(line)
        if m and m.group("name") == region:
            if m.group("kind") == "begin":
                inside = True
                continue
            if inside:
                return textwrap.dedent("\n".join(picked))
        if m:
            continue
        if inside:
            picked.append(line)
    raise ValueError(f"{path} has no complete region '{region}' (docs-begin/docs-end: {region})")


def check(root, md):
    problems = []
    rel = md.relative_to(root) if md.is_relative_to(root) else md
    for line, info, body, previous in blocks(md.read_text()):
        language = info.split()[0] if info else ""
        marker = MARKER.match(previous)
        if language in SHELL_OR_OUTPUT and not marker:
            continue
        if not marker:
            what = f"a '{language}' block" if language else "a block without a language"
            problems.append(
                f"{rel}:{line}: {what} is neither shell/console/text nor extracted from a built "
                "example; put <!-- example: PATH[#REGION] --> on the line before it"
            )
            continue
        try:
            expected = extract(root, marker.group("path"), marker.group("region"))
        except ValueError as e:
            problems.append(f"{rel}:{line}: {e}")
            continue
        if normalize(expected) != normalize(body):
            where = marker.group("path") + (f"#{marker.group('region')}" if marker.group("region") else "")
            got, want = normalize(body).split("\n"), normalize(expected).split("\n")
            first = next(
                (k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want))
            )
            problems.append(
                f"{rel}:{line + 1 + first}: block differs from {where} at its line {first + 1}: "
                f"doc has {got[first] if first < len(got) else '<end>'!r}, "
                f"source has {want[first] if first < len(want) else '<end>'!r}"
            )
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=pathlib.Path(__file__).resolve().parents[2], type=pathlib.Path)
    parser.add_argument("files", nargs="*", type=pathlib.Path)
    args = parser.parse_args()
    root = args.root.resolve()
    files = [f.resolve() for f in args.files] or sorted((root / "docs").glob("*.md"))
    problems = []
    count = 0
    for md in files:
        found = check(root, md)
        problems += found
        count += 1
    for p in problems:
        print(p)
    print(f"check_docs: {count} files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
