import subprocess
import sys

import verl_replay


def test_import_is_light():
    """``import verl_replay`` must not pull in verl, ray or torch (public names resolve lazily)."""
    code = "import sys, verl_replay; print(sorted(m for m in ('verl', 'ray', 'torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_every_public_name_resolves():
    for name in verl_replay.__all__:
        assert getattr(verl_replay, name) is not None, name
