"""Every code example in docs/*.md runs as a doctest.

Examples create their spools under ``tempfile.mkdtemp(dir="/dev/shm")`` and
remove them at the end. If an example fails before that, the directories it
created are cleaned up here, so a failing doc never leaks into /dev/shm.
"""

import doctest
import glob
import os
import shutil
import tempfile

import pytest

import shmq

DOCS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "*.md")))
MUST_HAVE_EXAMPLES = {"guide.md"}


@pytest.mark.parametrize("path", DOCS, ids=os.path.basename)
def test_doc_examples(path, monkeypatch):
    made = []
    real_mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        d = real_mkdtemp(*args, **kwargs)
        made.append(d)
        return d

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    try:
        result = doctest.testfile(
            path, module_relative=False,
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    finally:
        for d in made:
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                try:
                    shmq.Spool.destroy(os.path.join(d, name))
                except Exception:
                    pass
            shutil.rmtree(d, ignore_errors=True)
    assert not made or not any(os.path.exists(d) for d in made)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {path}"
    if os.path.basename(path) in MUST_HAVE_EXAMPLES:
        assert result.attempted > 0, f"no examples found in {path}"
