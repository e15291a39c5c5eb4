"""Started by tests/test_launch.py under ddipp.launch: rank 1 exits with the status given (a scheduler's requeue or
"nothing to do" code), rank 0 waits until the launcher stops it."""
import os
import signal
import sys

if os.environ["RANK"] == "1":
    sys.exit(int(sys.argv[1]))
signal.pause()
