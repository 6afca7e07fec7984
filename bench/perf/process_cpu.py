"""Where a command's CPU goes, by kind of process: test workers, app servers, Chromium's renderers, Ray, ...

`/usr/bin/time` counts only the processes its child waits for, so the app servers forked from the tests'
forkserver, Chromium's renderers and Ray's workers are missing from its figure. This polls every process in
/proc four times a second while the command runs and sums each one's user and kernel CPU by kind:

    python3 bench/perf/process_cpu.py -- bash .ci/run        # in a fresh clone (bench/results/notes.md)

A process that lives less than a poll's interval is missed; the last quarter-second of each process is too.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading

HZ = os.sysconf("SC_CLK_TCK")
POLL_S = 0.25


def kind(cmdline: str) -> str:
    """A process's kind from its command line (the first words of it where no kind fits)."""
    if "chromium" in cmdline or "chrome" in cmdline:
        types = re.findall(r"--(?:type|utility-sub-type)=(\S+)", cmdline)
        return "chromium " + (" ".join(types) if types else "browser")
    for needle, name in (("forkserver", "app servers and their forkserver"), ("exec(eval(sys.stdin", "test workers"),
                         ("ray", "ray"), ("ipykernel", "notebook kernel"), ("pytest", "pytest (controller)"),
                         ("multiprocessing.spawn", "spawned (slmviz prepare's models)"),
                         ("playwright/driver", "playwright driver")):
        if needle in cmdline:
            return name
    return "other: " + cmdline[:60]


def cpu_ticks(pid: int) -> tuple[int, int, int] | None:
    """(start time, user ticks, kernel ticks) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19]), int(fields[11]), int(fields[12])


def command_line(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


class Poller:
    """Each process seen: its kind and its CPU ticks at the first and the last poll (from 0 if it started after
    the first poll)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], list] = {}
        self.stop = threading.Event()
        self._first = True

    def poll(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            ticks = cpu_ticks(pid)
            if ticks is None:
                continue
            start, user, system = ticks
            row = self.seen.get((pid, start))
            if row is None:
                cmdline = command_line(pid)
                if cmdline is None:
                    continue
                base = (user, system) if self._first else (0, 0)
                self.seen[(pid, start)] = [kind(cmdline), *base, user, system]
            else:
                row[3], row[4] = user, system
        self._first = False

    def run(self) -> None:
        while not self.stop.wait(POLL_S):
            self.poll()

    def totals(self) -> list[tuple[str, float, float]]:
        sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for name, user0, system0, user, system in self.seen.values():
            sums[name][0] += (user - user0) / HZ
            sums[name][1] += (system - system0) / HZ
        return sorted(((k, u, s) for k, (u, s) in sums.items()), key=lambda row: -(row[1] + row[2]))


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print(__doc__)
        return 2
    command = argv[argv.index("--") + 1:]
    poller = Poller()
    poller.poll()
    thread = threading.Thread(target=poller.run, daemon=True)
    thread.start()
    code = subprocess.call(command)
    poller.stop.set()
    thread.join()
    poller.poll()
    print("| process kind | CPU-s | user | kernel |\n|---|---|---|---|")
    for name, user, system in poller.totals():
        if user + system >= 0.5:
            print(f"| {name} | {user + system:.1f} | {user:.1f} | {system:.1f} |")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
