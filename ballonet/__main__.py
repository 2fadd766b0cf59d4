import os
import sys

from ballonet.cli import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# Leave without running interpreter teardown: after a run that used torch.distributed,
# a gloo worker thread can still be joinable when C++ static destructors run, and the
# process then aborts ("terminate called without an active exception", exit -6) after
# it has already reported its result. Everything a command writes is closed by now.
os._exit(code)
