"""Run `python -m nanotron_ext.train`'s main (same arguments) as a launcher's worker script, then print the threads
this process still has, Python and native (with their kernel names), and exit with main's code: a test asserts
that only the main thread reaches interpreter exit (issue 21 item 6)."""
import os
import sys
import threading

from nanotron_ext.train.__main__ import main

code = main(sys.argv[1:])
native = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
python = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
print(f"threads at exit, rank {os.environ.get('RANK')}: native {len(native)} {native}, python {python}", flush=True)
sys.exit(code)
