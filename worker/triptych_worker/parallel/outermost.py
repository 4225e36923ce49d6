"""Forward hooks that stay on whatever module sits at a path of the transformer now.

    hooks = OutermostHooks(transformer)
    hooks.add("proj_out", join)  # on transformer.proj_out, or on the peft layer that wraps it later

A LoRA adapter that targets a layer wraps it in a peft layer whose forward calls the original (its
`base_layer`) and adds the adapter's product; unloading the adapters may unwrap it again. A hook that
must see the adapter's part too (the sequence-parallel join after `proj_out`, a row-parallel layer's
all-reduce) belongs on the outermost module at its path, never on a wrapped base layer: before each
transformer call the hooks move to whatever sits at their paths then (a dict lookup each).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Hook = Callable[[Any, Any, Any], Any]  # torch's forward hook: (module, args, output) -> the new output


@dataclass
class _Hooked:
    parent: Any  # the module whose child the path names (peft replaces the child there)
    child: str
    hook: Hook
    module: Any  # where the hook is now
    handle: Any


class OutermostHooks:
    """The transformer's hooks that follow their paths' modules (see the module's docstring)."""

    def __init__(self, transformer: Any):
        self._transformer = transformer
        self._hooked: list[_Hooked] = []
        transformer.register_forward_pre_hook(self._follow)

    def add(self, path: str, hook: Hook) -> None:
        parent_path, _, child = path.rpartition(".")
        parent = self._transformer.get_submodule(parent_path) if parent_path else self._transformer
        module = parent._modules[child]
        self._hooked.append(_Hooked(parent, child, hook, module, module.register_forward_hook(hook)))

    def _follow(self, transformer: Any, args: Any) -> None:
        for hooked in self._hooked:
            now = hooked.parent._modules[hooked.child]
            if now is not hooked.module:
                hooked.handle.remove()
                hooked.module, hooked.handle = now, now.register_forward_hook(hooked.hook)
