#!/usr/bin/env python3
"""Checks the library's include graph: modules only include downwards, and no cycles.

Modules, lowest first: core, topology, collectives, packing, trainer, bindings (a folder's
subfolders belong to it: collectives/check is part of collectives). A file may include headers of
its own module and of lower ones, never of a higher one.

Cycles: among the units of core/, topology/ and collectives/ (a .h and its .cc are one unit,
named by the path without extension), no unit may reach itself through includes. The registry
(collectives/registry.cc), which names every algorithm, is the one exception: its includes are
not edges.

Prints every violation and exits 1 when there is one; prints a one-line summary otherwise.
Usage: scripts/check_includes.py [repository root]
"""
import os
import re
import sys

MODULES = ["core", "topology", "collectives", "packing", "trainer", "bindings"]
CYCLE_MODULES = {"core", "topology", "collectives"}
EXCEPTIONS = {"collectives/registry.cc"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def module_of(path):
    top = path.split("/", 1)[0]
    return top if top in MODULES else None


def sources(root):
    for module in MODULES:
        for folder, _, files in os.walk(os.path.join(root, module)):
            for name in sorted(files):
                if name.endswith((".h", ".cc", ".cu")):
                    yield os.path.relpath(os.path.join(folder, name), root)


def find_cycles(graph):
    """Every elementary cycle's smallest rotation, found once (Tarjan SCCs, then DFS per SCC)."""
    index, low, stack, on_stack, sccs, counter = {}, {}, [], set(), [], [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = set()
    for scc in sccs:
        members = set(scc)
        for start in scc:
            path = [start]

            def walk(v):
                for w in sorted(graph.get(v, ())):
                    if w not in members or w < start:
                        continue
                    if w == start:
                        cycles.add(tuple(path))
                    elif w not in path and len(path) < 12:
                        path.append(w)
                        walk(w)
                        path.pop()

            walk(start)
    return sorted(cycles)


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    problems = []
    graph = {}
    files = 0
    for path in sources(root):
        files += 1
        with open(os.path.join(root, path), encoding="utf-8") as f:
            text = f.read()
        mine = module_of(path)
        unit = os.path.splitext(path)[0]
        for target in INCLUDE.findall(text):
            theirs = module_of(target)
            if theirs is None:
                continue  # generated or third-party header
            if MODULES.index(theirs) > MODULES.index(mine):
                problems.append(f"{path}: includes {target}, from higher module '{theirs}'")
            if path in EXCEPTIONS:
                continue
            if mine in CYCLE_MODULES and theirs in CYCLE_MODULES:
                other = os.path.splitext(target)[0]
                if other != unit:
                    graph.setdefault(unit, set()).add(other)
    for cycle in find_cycles(graph):
        problems.append("cycle: " + " -> ".join(cycle + (cycle[0],)))
    for p in problems:
        print(p)
    if problems:
        print(f"check_includes: {len(problems)} problem(s) in {files} files")
        return 1
    print(f"check_includes: {files} files, no upward include, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
