"""A checkout's root on `sys.path` (pytest, `python -c` run there) makes its `kernels/` folder
importable as the top-level `kernels`, Hugging Face's package name: it must stand aside.

Each case runs a fresh interpreter in the repository root, importing nothing of pagedctl first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *flags: str) -> dict:
    """`code` in a new interpreter in the repository root; the JSON it prints last."""
    proc = subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _hub_kernels_installed() -> bool:
    try:
        distribution("kernels")
    except PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _hub_kernels_installed(), reason="Hugging Face's kernels not installed")
def test_transformers_gets_hub_kernels_from_the_root() -> None:
    # transformers' hub-kernels integration does `from kernels import CUDAProperties, ...`
    where = _run(
        "import json, sys\n"
        "import transformers.integrations.hub_kernels\n"
        "import kernels\n"
        "print(json.dumps({'file': kernels.__file__, 'get_kernel': hasattr(kernels, 'get_kernel'),"
        " 'ours_loaded': sorted(m for m in sys.modules if m == 'kernels.reference')}))"
    )
    assert not Path(where["file"]).resolve().is_relative_to(ROOT / "kernels"), where
    assert where["get_kernel"] and where["ours_loaded"] == [], where


def test_stands_aside_for_another_kernels_distribution(tmp_path: Path) -> None:
    fake = tmp_path / "site"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "__init__.py").write_text("from kernels import sub\nMARK = 'hub'\n")
    (fake / "kernels" / "sub.py").write_text("")
    (fake / "kernels-9.9.dist-info").mkdir()
    (fake / "kernels-9.9.dist-info" / "METADATA").write_text("Name: kernels\nVersion: 9.9\n")
    where = _run(
        "import json, sys\n"
        f"sys.path.insert(1, {str(fake)!r})\n"  # after '' (the root), before site-packages
        "import pagedctl.kernels as ours\n"
        "import kernels\n"
        "print(json.dumps({'mark': getattr(kernels, 'MARK', None), 'file': kernels.__file__,"
        " 'sub': kernels.sub.__file__, 'in_modules': sys.modules['kernels'] is kernels,"
        " 'ours': ours.__file__, 'ours_ops': callable(ours.paged_attention),"
        " 'reference': 'kernels.reference' in sys.modules}))"
    )
    assert where["mark"] == "hub" and where["in_modules"], where
    assert where["file"] == str(fake / "kernels" / "__init__.py"), where
    assert where["sub"] == str(fake / "kernels" / "sub.py"), where
    assert where["ours"] == str(ROOT / "kernels" / "__init__.py") and where["ours_ops"], where
    assert not where["reference"], where  # our submodules went with the mistaken module


def test_no_other_kernels_is_module_not_found() -> None:
    # -S: no site-packages, so neither Hugging Face's kernels nor torch: the folder must raise as
    # if it were not there, before importing anything of its own (torch first of all)
    where = _run(
        "import json, sys\n"
        "try:\n"
        "    import kernels\n"
        "    print(json.dumps({'imported': kernels.__file__}))\n"
        "except ModuleNotFoundError as e:\n"
        "    print(json.dumps({'name': e.name, 'message': str(e),"
        " 'left': sorted(m for m in sys.modules if m.split('.')[0] in ('kernels', 'torch'))}))",
        "-S",
    )
    assert where == {"name": "kernels", "message": "No module named 'kernels'", "left": []}
