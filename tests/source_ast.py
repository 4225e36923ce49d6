"""`ast.parse` for the tests that scan the project's sources, safe from CPython 3.11's AST bug.

CPython 3.11 keeps the AST constructor's recursion bookkeeping in per-interpreter state, so an
`ast.parse` that runs while another thread is inside one fails with "SystemError: AST constructor
recursion depth mismatch" (python/cpython#106905). Another thread parses more often than it seems:
3.11 formats every traceback it prints with `ast.parse` (the ^^^ under the failing expression), so a
test server's thread logging an error meanwhile is enough (seen in CI: a test HTTP server's
BrokenPipeError printed during tests/unit/test_roles.py). The parse runs on a fresh thread and is
tried again when that error is the interpreter's, not the source's; a real SyntaxError is raised at
once.
"""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor

ATTEMPTS = 5
_RACE = "AST constructor recursion depth mismatch"


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    for attempt in range(ATTEMPTS):
        try:
            with ThreadPoolExecutor(1) as pool:
                return pool.submit(ast.parse, source, filename).result()
        except SystemError as exc:
            if _RACE not in str(exc) or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
