"""`ast.parse` for the tests that scan the project's sources, on a thread of its own.

CPython 3.11's AST constructor keeps its recursion bookkeeping in the thread state, and after a deep
recursion earlier in the same thread (the HTTP fuzz tests' 5,000-deep bodies, in the same pytest
process) it can fail with "SystemError: AST constructor recursion depth mismatch"
(python/cpython#106905). A fresh thread starts with a clean state.
"""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(ast.parse, source, filename).result()
