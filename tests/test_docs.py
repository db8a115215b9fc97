"""The documentation site builds with no warning: every page, link, anchor and
docstring the API reference renders (mkdocs.yml sets strict mode).

Needs the ``docs`` extra (part of ``test``); skipped, with the reason, where it
is not installed.  The site goes to a temporary directory, never into the tree.
"""

import os
import subprocess
import sys

import pytest

from conftest import bound

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MKDOCS_YML = os.path.join(ROOT, "mkdocs.yml")

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings-python is not installed")


@pytest.mark.skipif(not os.path.exists(MKDOCS_YML), reason="no source tree (mkdocs.yml) here")
def test_site_and_api_reference_build_strict(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", MKDOCS_YML,
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=bound(300))
    warnings = [ln for ln in out.stderr.splitlines() if ln.startswith(("WARNING", "ERROR"))]
    assert out.returncode == 0 and not warnings, out.stderr[-4000:]
    # The reference is really generated: a documented method of Spool is on its page.
    page = (tmp_path / "site" / "reference" / "spool" / "index.html").read_text()
    assert "shmq.spool.Spool" in page and "reserve" in page


def test_reference_lists_every_public_name():
    """Each name in ``shmq.__all__`` (classes and errors) is rendered by some reference page."""
    import shmq

    pages = os.path.join(ROOT, "docs", "reference")
    if not os.path.isdir(pages):
        pytest.skip("no source tree (docs/reference) here")
    text = "".join(open(os.path.join(pages, f)).read() for f in os.listdir(pages) if f.endswith(".md"))
    modules_rendered_whole = [ln.split()[1] for ln in text.splitlines()
                              if ln.startswith("::: ") and ln.count(".") == 1]
    rendered = {ln.split()[1] for ln in text.splitlines() if ln.startswith("::: ")}
    missing = []
    for name in shmq.__all__:
        obj = getattr(shmq, name)
        if not isinstance(obj, type) or obj.__module__ in modules_rendered_whole:
            continue
        # a compiled type (its __module__ is "shmq") is documented from shmq/_core.pyi
        where = "shmq._core" if obj.__module__ == "shmq" else obj.__module__
        if f"{where}.{obj.__qualname__}" not in rendered:
            missing.append(f"{name} ({where}.{obj.__qualname__})")
    assert not missing, f"public names with no reference entry: {missing}"
