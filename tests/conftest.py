"""Interpreter runs of the Triton kernels check every memory access (tests/interp_bounds.py), and
start as soon as the tests are collected, beside the rest of the suite (tests/interp_suite.py)."""

import os

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRETED:
    from tests.interp_bounds import install

    install()


@pytest.hookimpl(trylast=True)  # after -k and -m deselected what they deselect
def pytest_collection_modifyitems(items):
    if INTERPRETED:
        return
    from tests import interp_suite

    for item in items:
        if item.name == "test_interpreter_suite":
            interp_suite.start(str(item.path))


def pytest_unconfigure(config):
    if not INTERPRETED:
        from tests import interp_suite

        interp_suite.stop_all()  # a child whose test did not run (-x, a failure before it)
