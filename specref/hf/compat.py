"""The transformers versions specref runs on, checked when a cache or a target is built.

specref drives HuggingFace models through two parts of transformers that change between minor
versions: kv_rollback.py subclasses `transformers.cache_utils.CacheLayerMixin` (one cache layer,
held by a `Cache`), and target.py passes that cache to `model.forward` under its keyword. Within 5.x,
the layer's abstract `get_max_cache_shape` became `get_max_length` (5.13), `get_mask_sizes` took a
`cache_position` tensor before it took a `query_length` int, and the forward keyword
`past_key_values` became `cache` (5.24; the old name is still accepted with a warning).

Supported: transformers >=5.13,<6 (5.0-5.12 lack the layer API above). Tested: 5.24.0, the version
the test suite runs on, and 5.13.1 and 5.23.0 (tests/test_kv_rollback.py, test_target.py and
hf/test_transformers_range.py).
`check_transformers()` compares the installed cache API with what specref relies on, once per
process, and raises TransformersVersionError naming the installed version and what changed, so
an incompatible install fails when a SpecCache or Target is built instead of inside a forward.
"""
from __future__ import annotations

import inspect
import types
from typing import Callable, Optional

TESTED_TRANSFORMERS = ">=5.13,<6"
TESTED_VERSIONS = ("5.13.1", "5.23.0", "5.24.0")

# method -> the named parameters (after self) specref's overrides take and transformers calls them
# with; `True`: our override also takes *args/**kwargs, so the base may add parameters after these
LAYER_METHODS: dict[str, tuple[tuple[str, ...], bool]] = {
    "lazy_initialization": (("key_states", "value_states"), False),
    "update": (("key_states", "value_states"), True),
    "get_mask_sizes": (("query_length",), False),
    "get_seq_length": ((), False),
    "get_max_length": ((), False),
}
CACHE_METHODS: dict[str, tuple[tuple[str, ...], bool]] = {
    "update": (("key_states", "value_states", "layer_idx"), True),  # inherited: calls layer.update
    "get_seq_length": (("layer_idx",), False),
    "get_mask_sizes": (("query_length", "layer_idx"), False),
    "get_max_length": (("layer_idx",), False),
}
LAYER_STATE = ("keys", "values", "is_initialized")  # set by CacheLayerMixin.__init__, read by us

_checked: Optional[str] = None  # the version that passed; None: not checked yet


class TransformersVersionError(RuntimeError):
    """The installed transformers does not have the API specref was written against."""


def _fail(version: str, what: str) -> TransformersVersionError:
    return TransformersVersionError(
        f"transformers {version}: {what} (specref's static cache, kv_rollback.py, and target.py rely "
        f"on the cache API of transformers 5.13+; tested: transformers {', '.join(TESTED_VERSIONS)}; "
        f"supported range {TESTED_TRANSFORMERS})")


def _positional_params(fn: Callable) -> list[str]:
    """Names of the parameters after `self` that callers may pass by position."""
    ps = list(inspect.signature(fn).parameters.values())[1:]
    pos = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in ps if p.kind in pos]


def _method_problem(cls: type, name: str, want: tuple[str, ...], extras_ok: bool) -> Optional[str]:
    """None if cls.name takes exactly the parameters `want` (more after them if extras_ok)."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    fn = getattr(cls, name, None)
    if not callable(fn):
        return f"{where} has no method '{name}'"
    got = _positional_params(fn)
    if got[:len(want)] != list(want) or (len(got) > len(want) and not extras_ok):
        return f"{where}.{name} takes ({', '.join(got)}), specref expects ({', '.join(want)})"
    return None


def _signature_problems(mixin: type, cache: type) -> list[str]:
    """Relied-on methods that are missing or take other parameters; abstract methods we lack."""
    out = [p for n, (w, x) in LAYER_METHODS.items() if (p := _method_problem(mixin, n, w, x))]
    out += [p for n, (w, x) in CACHE_METHODS.items() if (p := _method_problem(cache, n, w, x))]
    out += [f"CacheLayerMixin declares abstract method '{n}', which specref's cache layer does not "
            "implement" for n in sorted(getattr(mixin, "__abstractmethods__", ())) if n not in LAYER_METHODS]
    if "layers" not in inspect.signature(cache.__init__).parameters:
        out.append("Cache.__init__ takes no 'layers' argument (specref builds its layers itself)")
    return out


def _state_problems(mixin: type) -> list[str]:
    """CacheLayerMixin.__init__ must run without arguments and set the attributes we read."""
    probe = types.SimpleNamespace()
    try:
        mixin.__init__(probe)
    except Exception as e:  # noqa: BLE001 - any failure means the constructor changed
        return [f"CacheLayerMixin.__init__() no longer runs without arguments ({e})"]
    return [f"CacheLayerMixin.__init__ no longer sets '{a}'" for a in LAYER_STATE if not hasattr(probe, a)]


def _api_problems(cu: types.ModuleType) -> list[str]:
    """Everything specref needs from transformers.cache_utils that `cu` lacks or has changed."""
    mixin, cache = getattr(cu, "CacheLayerMixin", None), getattr(cu, "Cache", None)
    missing = [f"transformers.cache_utils has no '{n}'" for n, c in
               (("CacheLayerMixin", mixin), ("Cache", cache)) if not isinstance(c, type)]
    return missing or _signature_problems(mixin, cache) + _state_problems(mixin)


def check_transformers() -> None:
    """Raise TransformersVersionError unless the installed transformers has the cache API specref
    uses. The first success is cached: later calls cost one comparison."""
    global _checked
    import transformers

    version = str(getattr(transformers, "__version__", "unknown"))
    if _checked == version:
        return
    try:
        import transformers.cache_utils as cu
    except ImportError as e:
        raise _fail(version, f"transformers.cache_utils cannot be imported ({e})") from e
    problems = _api_problems(cu)
    if problems:
        raise _fail(version, "; ".join(problems))
    _checked = version


def cache_keyword(forward: Callable, name: str = "model") -> str:
    """The keyword `forward` takes the cache under: `cache` (5.24+) or `past_key_values` (earlier;
    also passed where forward only takes **kwargs, as 5.24 still accepts it)."""
    params = inspect.signature(forward).parameters
    for kw in ("cache", "past_key_values"):
        if kw in params:
            return kw
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return "past_key_values"
    import transformers

    raise _fail(transformers.__version__, f"{name}.forward takes neither 'cache' nor 'past_key_values' "
                f"(parameters: {', '.join(params)})")
