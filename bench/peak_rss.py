"""`python peak_rss.py OUT CMD...`: run CMD, then write to OUT the peak resident memory
(KiB) and the CPU seconds (user + system) of its whole process tree (every descendant that
was waited for: ranks included); exit with its exit code. Used by the bad-input sweep
(`sweep.py`) to bound each case."""

import resource
import subprocess
import sys

if __name__ == "__main__":
    code = subprocess.run(sys.argv[2:], check=False).returncode
    with open(sys.argv[1], "w") as f:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        f.write(f"{usage.ru_maxrss} {usage.ru_utime + usage.ru_stime:.2f}")
    sys.exit(code if code >= 0 else 128 - code)
