"""torch_fitting, ready only once the file named by DDIPP_TEST_GATE exists: a worker that starts as late as a test
wants (as one importing torch and fastai on a busy machine)."""
import os
import time
from pathlib import Path

while not Path(os.environ["DDIPP_TEST_GATE"]).exists():
    time.sleep(0.05)  # waits for the test's file, not for time to pass

from torch_fitting import place_data, run_fit  # noqa: E402,F401
