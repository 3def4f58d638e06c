"""`pagedctl`'s public names: the engine's, loaded on first use, are listed before they load."""

from __future__ import annotations

import subprocess
import sys


def test_dir_lists_the_lazy_engine_names_without_importing_torch() -> None:
    code = (
        "import sys, pagedctl; names = dir(pagedctl); "
        "print(sorted(set(pagedctl._ENGINE_NAMES) - set(names)), 'torch' in sys.modules, "
        "'LLM' in names, names == sorted(names))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["[]", "False", "True", "True"]


def test_every_listed_name_resolves() -> None:
    import pagedctl

    for name in pagedctl.__all__:
        assert name in dir(pagedctl)
        assert getattr(pagedctl, name) is not None
