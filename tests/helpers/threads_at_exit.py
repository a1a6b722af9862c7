"""Run `python -m nanotron_ext.train`'s main (same arguments) as a launcher's worker script, then print the threads
this process still has, Python and native (with their kernel names), and exit with main's code: a test asserts
that only the main thread reaches interpreter exit (issue 21 item 6)."""
import os
import sys
import threading
import time

from nanotron_ext.train.__main__ import main


def native_threads() -> list:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:  # the thread left between the listing and the read (CI saw it): it has exited
            pass
    return sorted(names)


code = main(sys.argv[1:])
# A thread that was just joined has released Python's state but may not have left the kernel's task list yet (CI
# once listed such a thread on a loaded machine): a live thread stays listed after 2 s, one that is exiting does not.
deadline = time.monotonic() + 2.0
while len(native := native_threads()) > 1 and time.monotonic() < deadline:
    time.sleep(0.05)
python = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
print(f"threads at exit, rank {os.environ.get('RANK')}: native {len(native)} {native}, python {python}", flush=True)
sys.exit(code)
