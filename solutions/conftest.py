"""pytest set-up for the complete notebooks, which nbval runs from this folder.

Every exercise check in a complete notebook must pass: with ``LABKIT_EXPECT_SOLVED=1`` a check
that does not pass raises after printing its line, so the cell fails. nbval starts each
notebook's kernel as its first cell is set up, with this process's environment, so setting
the variable here reaches the kernel. ``tests/conftest.py`` removes it again for the tests.
"""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    from labkit.exercises import EXPECT_SOLVED

    os.environ[EXPECT_SOLVED] = "1"
