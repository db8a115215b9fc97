"""Only shmq errors from bad files: every control and reader-slot word through hostile values.

The full sweep is ``stress/flipwords.py`` (every word, every value); the
suite runs a random sample of it (cases run in a child process, so a crash
fails the test cleanly instead of killing the run).
"""

import json
import os
import subprocess
import sys

import pytest

import shmq
from shmq import _core
from shmq import _format as F

from conftest import bound

STRESS = os.path.join(os.path.dirname(__file__), "..", "stress")


@pytest.mark.parametrize("seed", [1, 2])
def test_flipped_words_raise_only_shmq_errors(seed, tmp_path):
    out = tmp_path / "flip.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "flipwords.py"), "--sample", "150",
                           "--seed", str(seed), "--json", str(out)],
                          capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ran"] == rep["cases"] == 150 and rep["violations"] == []
    assert rep["outcomes"]["ok"] > 0 and rep["outcomes"]["shmq_error"] > 0  # both paths


def test_word_changed_between_check_and_core_is_a_spool_format_error(spool_path, monkeypatch):
    """A co-writer changes SEGMENT after the Python check, before the core reads it:
    the core's refusal reaches the caller as SpoolFormatError naming the file."""
    shmq.Spool.create(spool_path, capacity="64KiB").close()
    real = _core.Ring

    def racing_ring(mm, *args):
        memoryview(mm).cast("Q")[F.W_SEGMENT] = 12345  # not a whole number of pages
        return real(mm, *args)

    monkeypatch.setattr(_core, "Ring", racing_ring)
    with pytest.raises(shmq.SpoolFormatError, match="SEGMENT") as ei:
        shmq.Spool.open(spool_path)
    assert spool_path in str(ei.value) and type(ei.value) is shmq.SpoolFormatError
    monkeypatch.setattr(_core, "Ring", real)
    with pytest.raises(shmq.SpoolFormatError, match=spool_path):
        shmq.Spool.open(spool_path)  # the word stays bad: refused by the Python check now
