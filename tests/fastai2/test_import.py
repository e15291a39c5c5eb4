"""`import ddipp` leaves fastai v2's defaults.callbacks (the callbacks every new Learner gets) as they were: fastai adds
ProgressCallback there when something imports fastai.callback.progress, which must be the user's import, not ddipp's."""
import json
import os
import subprocess
import sys

import pytest

# in a fresh interpreter: the defaults' names after fastai.learner, after ddipp, after the user's
# fastai.callback.schedule
DEFAULTS = """
import json
from fastai.learner import defaults
names = lambda: [cb.__name__ for cb in defaults.callbacks]
seen = [names()]
import ddipp
seen.append(names())
from fastai.callback.schedule import *
seen.append(names())
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_import_ddipp_adds_no_progress_callback_to_fastais_defaults_and_fastais_own_import_still_does():
    proc = subprocess.run([sys.executable, "-c", DEFAULTS], env=dict(os.environ, PYTHONWARNINGS="ignore"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, with_ddipp, with_schedule = json.loads(proc.stdout.splitlines()[-1])
    assert "ProgressCallback" not in before and with_ddipp == before
    assert with_schedule == [*before, "ProgressCallback"]
