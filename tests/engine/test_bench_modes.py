"""Bench mode names parse into engine options (the bench itself is run by hand, not by the suite)."""

import pytest

from bench.modes import mode_options


@pytest.mark.parametrize("mode, options", [
    ("off", {"reuse": "off"}),
    ("approx", {"reuse": "approx"}),
    ("approx:none", {"reuse": "approx", "repair": "none"}),
    ("approx:selective@16/8", {"reuse": "approx", "repair": "selective", "selective_tokens": 16,
                               "selective_before": 8}),
    ("approx:cacheblend@0.15+16", {"reuse": "approx", "repair": "cacheblend", "blend_ratio": 0.15,
                                   "blend_seam_tokens": 16}),
    ("approx:cacheblend@0.05~random^4", {"reuse": "approx", "repair": "cacheblend", "blend_ratio": 0.05,
                                         "blend_select": "random", "probe_layer": 4}),
    ("approx:cacheblend@0.15~random+16", {"reuse": "approx", "repair": "cacheblend", "blend_ratio": 0.15,
                                          "blend_select": "random", "blend_seam_tokens": 16}),
])
def test_mode_names_parse(mode, options):
    assert mode_options(mode) == options


@pytest.mark.parametrize("mode", ["fast", "chunk:selective", "approx:magic", "approx:none@3", "approx:selective@x",
                                  "approx:selective@4+2", "approx:selective@4~random", "approx:cacheblend@0.1^x"])
def test_bad_mode_names_are_named(mode):
    with pytest.raises(ValueError, match="mode"):
        mode_options(mode)
