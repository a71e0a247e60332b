"""Dynamo helpers shared by the compiled regions (``polynya.compiled_layers``) and ZoRRo's
compiled FlexAttention (``polynya.zorro.attention``)."""
from __future__ import annotations

import types
from collections.abc import Callable


def fresh_function(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object. Dynamo keeps compiled graphs and its recompile
    budget (``torch._dynamo.config.recompile_limit``, 8) per code object, and past that budget it
    runs the function *eagerly* from then on without an error; copies do not share a budget, so
    one configuration cannot push another onto that path."""
    out = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    out.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else fn.__kwdefaults__
    out.__qualname__, out.__module__, out.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return out
