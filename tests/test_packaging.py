"""What the package needs installed: its declared dependencies are what it imports, and it runs
without Triton (not a dependency: torch's CUDA builds bring it; the CPU runs the reference ops).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.test_layering import PACKAGE_DIRS, collect_modules

ROOT = Path(__file__).resolve().parents[1]

# Imported by the package, deliberately not required: why, and the extra that brings it if any.
OPTIONAL = {
    "triton": (None, "the CUDA builds of torch bring it; imported on the first CUDA kernel call"),
    "matplotlib": ("plot", "`pagedctl capacity --plot` and `pagedctl sweep --plot` only"),
    "ray": ("ray", "`generate --replicas` and `pagedctl.engine.scale_out.ray_data` only"),
    "vllm": (None, "the bench peer, under an interpreter of its own (`bench/vllm_child.py`)"),
    "kernels": (
        None,
        "Hugging Face's, a dependency of transformers >= 5.25: imported ahead of it "
        "where a checkout's root is on sys.path, so that the checkout does not shadow it",
    ),
}
BLOCK_TRITON = 'import sys; sys.modules["triton"] = None  # `import triton` fails, as uninstalled\n'
PROMPTS = [[1, 5, 9, 200, 17, 3, 44], [7, 7, 7, 300]]


def _pyproject() -> dict:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _module_level(tree: ast.Module):
    """The module's own statements, into if/try/with blocks but not into functions or classes."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            stack.extend(n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt))


def third_party_imports() -> dict[str, list[tuple[str, int, bool]]]:
    """Top-level import name -> [(file, line, at module level)] over the package's modules."""
    found: dict[str, list[tuple[str, int, bool]]] = {}
    for path in collect_modules(ROOT, PACKAGE_DIRS).values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(n) for n in _module_level(tree)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                head = name.split(".")[0]
                if head in sys.stdlib_module_names or head in ("pagedctl", "__future__"):
                    continue
                where = (str(path.relative_to(ROOT)), node.lineno, id(node) in top)
                found.setdefault(head, []).append(where)
    return found


def _distribution(import_name: str) -> str:
    dists = packages_distributions().get(import_name)
    assert dists, f"{import_name} is imported but not installed here"
    return canonicalize_name(dists[0])


def test_dependencies_are_what_the_package_imports() -> None:
    project = _pyproject()["project"]
    declared = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    imports = third_party_imports()
    imported = {_distribution(name): name for name in imports if name not in OPTIONAL}
    undeclared = {d: imports[imported[d]][0] for d in imported.keys() - declared}
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"
    unused = declared - imported.keys()
    assert not unused, f"required but never imported: {sorted(unused)}"
    extras = {
        name: {canonicalize_name(Requirement(r).name) for r in reqs}
        for name, reqs in project["optional-dependencies"].items()
    }
    for name, (extra, _) in OPTIONAL.items():
        assert canonicalize_name(name) not in declared, f"{name} is forced onto every install"
        if extra:
            assert canonicalize_name(name) in extras[extra]
        eager = [w for w in imports.get(name, []) if w[2]]
        if name == "triton":  # at module level only in the Triton modules, imported on first use
            eager = [w for w in eager if not Path(w[0]).name.startswith("triton_")]
        if name == "ray":  # at module level only in the modules that are Ray's, imported on use
            eager = [w for w in eager if Path(w[0]).name not in ("ray_data.py", "ray_replica.py")]
        assert not eager, f"{name} imported at module level (an install without it breaks): {eager}"


def test_the_test_extra_pins_the_interpreters_triton_and_numpy() -> None:
    test = [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["test"]]
    pins = {(r.name, str(r.specifier)) for r in test}
    assert ("triton", "==3.9.0") in pins
    assert {("numpy", "==2.4.6"), ("numpy", "==2.2.6")} <= pins


def _run_without_triton(body: str, **env: str) -> subprocess.CompletedProcess:
    child_env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDCTL_KERNELS")
    }
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TRITON + textwrap.dedent(body)],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _generate(llm_cls, params_cls) -> dict:
    llm = llm_cls("tiny-llama", device="cpu", dtype="float32", num_blocks=32, block_size=16)
    greedy = params_cls(temperature=0.0, max_tokens=8, ignore_eos=True)
    sampled = params_cls(temperature=0.8, seed=3, n=2, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS[:1], sampled)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return {"tokens": [[c.token_ids for c in o.outputs] for o in outs]}


def import_every_module() -> tuple[list[str], dict[str, str]]:
    """Import each module of the package but the Triton ones (and `__main__`, which runs the
    CLI): (the modules left out, module -> the error of each one that failed)."""
    import importlib
    import traceback

    skipped, failed = [], {}
    for name in collect_modules(ROOT, PACKAGE_DIRS):
        if name.startswith("pagedctl.kernels.triton_") or name.endswith(".__main__"):
            skipped.append(name)
            continue
        try:
            importlib.import_module(name)
        except Exception as e:
            failed[name] = traceback.format_exception_only(e)[-1].strip()
    return skipped, failed


def test_every_module_imports() -> None:
    _, failed = import_every_module()
    assert not failed, "modules that do not import:\n" + "\n".join(
        f"{name}: {error}" for name, error in failed.items()
    )


def test_a_cpu_run_without_triton_installed() -> None:
    """Without Triton every module imports as it does with it (the Triton ones left out), and a
    dummy-weight preset generates on the CPU with the PyTorch reference ops: the same tokens as
    in this process, where Triton is there."""
    script = """
        import json
        from pagedctl import LLM, SamplingParams
        from tests.test_packaging import _generate, import_every_module

        result = _generate(LLM, SamplingParams)
        result["skipped"], result["failed"] = import_every_module()
        result["triton_modules"] = sorted(m for m in sys.modules if "triton" in m)
        print("RESULT", json.dumps(result))
    """
    proc = _run_without_triton(script)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    child = json.loads(line.removeprefix("RESULT "))
    # torch looks Triton up and takes the blocked entry for "not installed"; nothing of ours does
    assert [m for m in child["triton_modules"] if m.startswith("pagedctl")] == []
    assert "triton" in child["triton_modules"]  # the blocking entry is still there, unreplaced
    ours = [m for m in child["skipped"] if m != "pagedctl.__main__"]
    assert ours and all(m.startswith("pagedctl.kernels.triton_") for m in ours)
    here_skipped, here_failed = import_every_module()
    assert child["skipped"] == here_skipped
    assert child["failed"] == here_failed, "modules that import with Triton and not without it"

    from pagedctl import LLM, SamplingParams

    assert child["tokens"] == _generate(LLM, SamplingParams)["tokens"]


def test_forcing_the_kernels_without_triton_says_what_to_do() -> None:
    proc = _run_without_triton(
        """
        import torch
        from pagedctl import kernels
        kernels.silu_and_mul(torch.ones(2, 8))
        """,
        PAGEDCTL_KERNELS="triton",
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: the Triton kernels serve this call")
    assert "PAGEDCTL_KERNELS=triton" in last and "set PAGEDCTL_KERNELS=reference" in last


def test_the_checkouts_kernels_folder_does_not_shadow_hugging_faces() -> None:
    """From the checkout's root (`python -m`, pytest), `import kernels` after `import pagedctl`
    is Hugging Face's distribution (transformers >= 5.25 imports it with its models), not the
    folder that installs as `pagedctl.kernels`."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("kernels")
    except PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed")
    code = "import pagedctl, kernels; print(kernels.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert Path(done.stdout.strip()).resolve().parent != ROOT / "kernels"
