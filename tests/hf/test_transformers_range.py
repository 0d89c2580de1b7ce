"""The transformers range (specref/hf/compat.py): an incompatible cache API fails when a SpecCache or a
Target is built, with a message naming the installed version and what changed."""
import re
from abc import ABC, abstractmethod

import pytest
import torch
import transformers
import transformers.cache_utils as cu

from specref.hf import compat
from specref.hf.compat import TransformersVersionError, cache_keyword, check_transformers
from specref.kv_rollback import SpecCache, _RowLayer
from specref.models import tiny_model
from specref.target import Target

VERSION = transformers.__version__


@pytest.fixture
def unchecked(monkeypatch):
    """Forget the cached check for this test (monkeypatch restores it afterwards)."""
    monkeypatch.setattr(compat, "_checked", None)
    return monkeypatch


def _build_both():
    """Build a cache and a target: each must raise the same TransformersVersionError."""
    with pytest.raises(TransformersVersionError) as from_cache:
        SpecCache(1, 1, 4, torch.device("cpu"))
    compat._checked = None
    with pytest.raises(TransformersVersionError) as from_target:
        Target(tiny_model("llama", num_layers=1))
    assert str(from_cache.value) == str(from_target.value)
    return str(from_cache.value)


def test_installed_version_passes_and_is_cached(unchecked):
    check_transformers()
    assert compat._checked == VERSION
    unchecked.delattr(cu.CacheLayerMixin, "get_mask_sizes")  # not looked at again once checked
    check_transformers()
    SpecCache(1, 1, 4, torch.device("cpu"))


def test_compat_tables_match_what_kv_rollback_overrides():
    """compat checks the methods our subclasses define, and they define all it lists."""
    assert set(compat.LAYER_METHODS) <= set(vars(_RowLayer))
    assert set(compat.CACHE_METHODS) - {"update"} <= set(vars(SpecCache))
    assert not _RowLayer.__abstractmethods__


def test_missing_layer_method_fails_at_construction(unchecked):
    unchecked.delattr(cu.CacheLayerMixin, "get_mask_sizes")
    msg = _build_both()
    assert f"transformers {VERSION}:" in msg
    assert "CacheLayerMixin has no method 'get_mask_sizes'" in msg
    assert compat.TESTED_TRANSFORMERS in msg


def test_missing_mixin_fails_at_construction(unchecked):
    unchecked.delattr(cu, "CacheLayerMixin")
    msg = _build_both()
    assert VERSION in msg and "transformers.cache_utils has no 'CacheLayerMixin'" in msg


def test_changed_signature_is_reported(unchecked):
    """5.0 passed a cache_position tensor where later versions pass a query length."""
    unchecked.setattr(cu.CacheLayerMixin, "get_mask_sizes", lambda self, cache_position: (0, 0))
    unchecked.setattr(cu.Cache, "update",
                      lambda self, key_states, value_states, cache_kwargs=None, layer_idx=0: 0)
    msg = _build_both()
    assert VERSION in msg
    assert re.search(r"CacheLayerMixin\.get_mask_sizes takes \(cache_position\), specref expects "
                     r"\(query_length\)", msg)
    assert ("Cache.update takes (key_states, value_states, cache_kwargs, layer_idx), specref expects "
            "(key_states, value_states, layer_idx)") in msg


def test_old_abstract_api_is_reported(unchecked):
    """A mixin shaped like 5.12's: abstract get_max_cache_shape instead of get_max_length."""

    class OldMixin(ABC):
        def __init__(self):
            self.keys = self.values = None
            self.is_initialized = False

        @abstractmethod
        def lazy_initialization(self, key_states, value_states): ...

        @abstractmethod
        def update(self, key_states, value_states, *args, **kwargs): ...

        @abstractmethod
        def get_mask_sizes(self, query_length): ...

        @abstractmethod
        def get_seq_length(self): ...

        @abstractmethod
        def get_max_cache_shape(self): ...

    unchecked.setattr(cu, "CacheLayerMixin", OldMixin)
    msg = _build_both()
    assert VERSION in msg
    assert "OldMixin has no method 'get_max_length'" in msg
    assert "abstract method 'get_max_cache_shape'" in msg


def test_mixin_constructor_change_is_reported(unchecked):
    def init(self, config):
        self.is_initialized = False

    unchecked.setattr(cu.CacheLayerMixin, "__init__", init)
    assert "CacheLayerMixin.__init__() no longer runs without arguments" in _build_both()


def test_cache_keyword():
    def new(input_ids, cache=None): ...

    def old(input_ids, past_key_values=None): ...

    def wrapped(input_ids, **kwargs): ...

    def neither(input_ids, state=None): ...

    assert cache_keyword(new) == "cache" and cache_keyword(old) == "past_key_values"
    assert cache_keyword(wrapped) == "past_key_values"  # 5.24 still renames it (deprecated alias)
    with pytest.raises(TransformersVersionError, match=rf"transformers {re.escape(VERSION)}: m\.forward "
                       r"takes neither 'cache' nor 'past_key_values' \(parameters: input_ids, state\)"):
        cache_keyword(neither, "m")
