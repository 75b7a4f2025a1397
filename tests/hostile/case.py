"""The case helper: :func:`case` registers a case (its area, name, the hostile input, whether it must be refused or
go on, a check of what it must not have done) in :data:`CASES`, in the order the family modules are imported
(:mod:`tests.hostile.cases`). What the cases of several families share: :mod:`tests.hostile.commands` (the commands
they run), :mod:`tests.hostile.damage` (damaging an input, checking what must not have happened); how an outcome is
classified: :mod:`tests.hostile.outcome`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Case:
    """``setup(probe, tmp)`` returns the command (and optional extra environment and timeout); ``check(probe, tmp,
    result)`` returns a problem (silent damage, a missing documented effect) or None."""

    area: str
    name: str
    defect: str
    expect: str  # "error": must be refused; "ok": must go on (with the documented effect); "either"
    setup: Callable
    check: Callable | None = None
    timeout: float | None = None
    cleanup: Callable | None = None
    interrupt: str | None = None  # a path under the case folder: Ctrl-C to the command's group once it exists
    settle: float = 0.0  # seconds between the path appearing and the Ctrl-C
    foreign: Callable[[str], str] | None = None  # removes output that is not the project's (documented) first


CASES: list[Case] = []


def case(area: str, name: str, defect: str, expect: str = "error", timeout: float | None = None,
         check: Callable | None = None, interrupt: str | None = None, settle: float = 0.0,
         foreign: Callable[[str], str] | None = None):
    def wrap(setup):
        CASES.append(Case(area, name, defect, expect, setup, check, timeout, interrupt=interrupt, settle=settle,
                          foreign=foreign))
        return setup
    return wrap
