"""Where `make test`'s CPU goes: the machine's busy CPU-seconds during each test, servers, Chromium and Ray included.

`/usr/bin/time` counts only the processes its child reaps, so the app servers forked from the tests' forkserver,
Chromium's renderers and Ray's workers are missing from its CPU figure. This pytest plugin reads the machine's own
counters (`/proc/stat`) around each test instead; run the suite alone on a quiet machine, one process, so that the
machine's busy time is the test's:

    PYTHONPATH=bench/perf SUITE_CPU_OUT=/tmp/suite_cpu.json .venv/bin/python -m pytest -q -p suite_cpu -p no:xdist tests
    .venv/bin/python bench/perf/suite_cpu.py /tmp/suite_cpu.json     # by kind, by module, the largest tests

bench/results/notes.md ("make test's CPU") has the figures of 2026-12-07.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest

HZ = os.sysconf("SC_CLK_TCK")
_rows: list[dict] = []


def cpu_seconds() -> tuple[float, float]:
    """The machine's CPU-seconds spent not idle (nor waiting on I/O) since boot, over every core, and of them those
    in the kernel (system, irq, softirq): on these
    virtual machines mostly first touches of memory the host had reclaimed (bench/results/notes.md)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / HZ, (v[2] + v[5] + v[6]) / HZ


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (busy, kernel), start = cpu_seconds(), time.monotonic()
    yield
    busy2, kernel2 = cpu_seconds()
    _rows.append({"id": item.nodeid, "wall": time.monotonic() - start, "cpu": busy2 - busy, "sys": kernel2 - kernel})


def pytest_sessionfinish(session):
    with open(os.environ.get("SUITE_CPU_OUT", "suite_cpu.json"), "w") as f:
        json.dump(_rows, f)


def kind(module: str) -> str:
    if "browser" in module:
        return "browser modules"
    if module.endswith(("_app.py", "app_load.py", "app_shutdown.py", "polish_build.py")):
        return "modules driving a server (gradio_client)"
    return "library and other modules"


def report(path: str, top: int = 25) -> None:
    with open(path) as f:
        rows = json.load(f)
    by_module: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, 0.0])
    by_kind: collections.Counter = collections.Counter()
    for r in rows:
        m = r["id"].split("::")[0]
        by_module[m][0] += r["cpu"]
        by_module[m][1] += r["wall"]
        by_module[m][2] += 1
        by_module[m][3] += r.get("sys", 0.0)
        by_kind[kind(m)] += r["cpu"]
    print(f"{len(rows)} tests: {sum(r['cpu'] for r in rows):.0f} CPU-s in {sum(r['wall'] for r in rows):.0f} s")
    for k, v in by_kind.most_common():
        print(f"  {v:7.0f} CPU-s  {k}")
    print(f"  {sum(r.get('sys', 0.0) for r in rows):7.0f} CPU-s of them in the kernel")
    print("\n| module | CPU-s | of it kernel | wall s | tests |\n|---|---|---|---|---|")
    for m, (c, w, n, k) in sorted(by_module.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {m.split('/')[-1]} | {c:.0f} | {k:.0f} | {w:.0f} | {n} |")
    print("\nlargest tests (CPU-s, of it kernel, wall s):")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        print(f"  {r['cpu']:6.1f} {r.get('sys', 0.0):6.1f} {r['wall']:6.1f}  {r['id']}")


if __name__ == "__main__":
    report(sys.argv[1] if len(sys.argv) > 1 else "suite_cpu.json")
