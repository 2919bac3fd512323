import os
import sys

from millpond.surface.cli import main

code = main()
# Exit without interpreter teardown: native runtimes (delta-rs/DataFusion, Arrow thread pools) can abort
# in their destructors at exit ("terminate called without an active exception") after all work is done.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
