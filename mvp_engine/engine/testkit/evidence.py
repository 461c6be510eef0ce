"""A check's verdict and the numbers behind it: one ``PASS|FAIL name: evidence`` line, so a review quotes numbers."""

from __future__ import annotations

import traceback
from dataclasses import dataclass


@dataclass
class CheckResult:
    """One check's verdict and the evidence it rests on."""

    name: str
    ok: bool
    evidence: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.evidence}"


def verdict(problems: list[str], evidence: str) -> tuple[bool, str]:
    """Evidence always; the problems first when there are any, so a FAIL line says what broke."""
    return (not problems, evidence if not problems else "; ".join(problems) + " | " + evidence)


def eq(counted, expected) -> str:
    """``a = b`` or ``a != b``: evidence that reads right whether the check passed or not."""
    return f"{counted} {'=' if counted == expected else '!='} {expected}"


def first_line(err: BaseException) -> str:
    """The error's first line; for a bare ``assert`` (no message) the failing source line, which says what broke."""
    lines = str(err).strip().splitlines()
    if lines:
        return lines[0]
    frames = traceback.extract_tb(err.__traceback__)
    return frames[-1].line if frames and frames[-1].line else type(err).__name__
