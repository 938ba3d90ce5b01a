"""bench/cpu.py books CPU only to the calling process's tree: other work on a shared machine,
under the same program names, is not a cost of the benchmark's pods."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from bench import cpu


def test_only_descendants_of_the_root_count() -> None:
    # pid → (program, parent, seconds): 10 is the root, 11 its child, 12 a grandchild; 20 runs
    # the same program elsewhere; 30 and 31 are each other's parent (a pid reused meanwhile).
    found = {
        10: ("bench", 1, 1.0),
        11: ("kube-apiserver", 10, 2.0),
        12: ("admission", 11, 3.0),
        20: ("admission", 1, 4.0),
        30: ("allocator", 31, 5.0),
        31: ("allocator", 30, 6.0),
    }
    assert [pid for pid in found if cpu._descends(pid, 10, found)] == [10, 11, 12]


def test_a_child_counts_and_an_orphan_of_the_same_kind_does_not() -> None:
    # Named as the meter names known binaries (argv[0]'s basename), both running sleep
    # (-3: subprocess.DEVNULL, so the orphan does not hold open the pipes this reads).
    child = subprocess.Popen(["etcd", "30"], executable="/bin/sleep")
    spawn = (
        "import subprocess as s;"
        "print(s.Popen(['etcd', '30'], executable='/bin/sleep', stdout=-3, stderr=-3).pid)"
    )
    # Started by a process that exits at once: the orphan is re-parented out of this tree.
    orphan = int(subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True).stdout)
    try:
        times = cpu._proc_times()
        assert times[os.getpid()][0] == "bench (client + watches)"
        assert times[child.pid][0] == "etcd"
        assert orphan not in times
    finally:
        child.kill()
        child.wait()
        os.kill(orphan, signal.SIGKILL)
