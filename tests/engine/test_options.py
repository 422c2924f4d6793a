"""Options as data: each load and engine option is one dataclass field, and the command lines, from_pretrained's
keywords and with_options are read from the fields (engine.config.options)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine.config import (
    ChunkingConfig,
    DecodeConfig,
    EngineConfig,
    LoadOptions,
    RepairConfig,
    ReuseConfig,
    TierConfig,
    options,
    split_options,
)


def _engine_flags() -> argparse.ArgumentParser:
    from cli.kvboost import add_engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    return parser


def _dests(parser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def _commands():
    from cli.kvboost import build_parser
    from cli.server import build_server_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    yield "kvboost-server", build_server_parser()
    for name in ("chat", "run", "warm"):
        yield f"kvboost {name}", subparsers.choices[name]


@pytest.mark.parametrize("command", ["kvboost-server", "kvboost chat", "kvboost run", "kvboost warm"])
def test_every_option_is_a_flag_with_its_default_choices_and_help(command):
    parser = dict(_commands())[command]
    flags = _dests(parser)
    for name, opt in options().items():
        assert name in flags, f"{command} has no flag for the option {name}"
        action = flags[name]
        assert action.option_strings[0] == "--" + name.replace("_", "-")
        assert action.default == opt.default, name
        assert opt.help and opt.help.replace("%", "%%") in action.help, name
        if opt.choices is not None:
            assert list(action.choices) == ["off" if c is None else c for c in opt.choices], name


def test_the_engine_flags_are_the_options_and_nothing_else():
    assert set(_dests(_engine_flags())) - {"model", "threads"} == set(options())


def test_every_dataclass_field_is_an_option():
    """A field added to a config class is an option (and so a flag) without being listed anywhere."""
    def leaves(cls, path=()):
        for f in dataclasses.fields(cls):
            nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(nested) and not f.metadata.get("choices"):
                yield from leaves(nested, path + (f.name,))
            else:
                yield path + (f.name,)

    paths = {opt.path for opt in options().values()}
    assert set(leaves(LoadOptions)) | set(leaves(EngineConfig)) == paths


# Which part of the engine config owns each option, as the split into three parts intends (written out, so a field
# moved to another part is a decision this test is edited for).
REUSE_OPTIONS = {"reuse", "chunking", "chunk_size", "chunk_window", "repair", "selective_tokens", "selective_before",
                 "blend_ratio", "probe_layer", "blend_seam_tokens", "blend_select"}
TIER_OPTIONS = {"cache_bytes", "cpu_cache_bytes", "disk_cache_bytes", "disk_cache_dir", "disk_busy_timeout_s",
                "kv_quant", "eviction", "remote_cache", "remote_timeout_s", "remote_max_wait_s", "remote_retry_s",
                "remote_max_value_bytes"}
DECODE_OPTIONS = {"speculative", "num_draft", "live_kv_bytes", "live_page_tokens", "prefill_piece_tokens",
                  "cuda_graphs"}


def test_reuse_tiers_and_decode_each_own_their_options_and_together_every_engine_option():
    config = EngineConfig()
    assert (type(config.reuse), type(config.tiers), type(config.decode)) == (ReuseConfig, TierConfig, DecodeConfig)
    owned = {part: {name for name, opt in options().items() if opt.owner is EngineConfig and opt.path[0] == part}
             for part in ("reuse", "tiers", "decode")}
    assert owned == {"reuse": REUSE_OPTIONS, "tiers": TIER_OPTIONS, "decode": DECODE_OPTIONS}
    assert not REUSE_OPTIONS & TIER_OPTIONS and not REUSE_OPTIONS & DECODE_OPTIONS and not TIER_OPTIONS & DECODE_OPTIONS
    engine_options = {name for name, opt in options().items() if opt.owner is EngineConfig}
    assert REUSE_OPTIONS | TIER_OPTIONS | DECODE_OPTIONS == engine_options


def test_engine_config_of_takes_flat_names_and_builds_the_nested_config():
    nested = EngineConfig(reuse=ReuseConfig(chunking=ChunkingConfig(size=64)), tiers=TierConfig(cache_bytes=0),
                          decode=DecodeConfig(num_draft=2))
    assert EngineConfig.of(chunk_size=64, cache_bytes=0, num_draft=2) == nested
    assert EngineConfig.of() == EngineConfig()
    assert EngineConfig.of(repair="none", gpu_cache_bytes=5) == EngineConfig(  # an older name too
        reuse=ReuseConfig(repair=RepairConfig(mode="none")), tiers=TierConfig(cache_bytes=5))
    with pytest.raises(TypeError, match="chunksize"):
        EngineConfig.of(chunksize=64)
    with pytest.raises(TypeError, match="weights"):  # a load option is no engine option
        EngineConfig.of(weights="int4")
    with pytest.raises(ValueError, match="chunk_size"):  # checked as from_pretrained's keywords are
        EngineConfig.of(chunk_size=2)


def test_parsed_flags_reach_the_load_options_and_the_engine_config():
    from cli.kvboost import engine_options

    args = _engine_flags().parse_args([
        "--weights", "int4", "--group-size", "64", "--chunk-size", "64", "--repair", "none", "--speculative", "off",
        "--remote-timeout", "0.5", "--kv-quant", "int8", "--no-cuda-graphs", "--gpu-cache-bytes", "1000",
        "--selective-tokens", "4"])
    load, config = split_options(engine_options(args))
    assert (load.weights, load.group_size) == ("int4", 64)
    reuse, tiers, decode = config.reuse, config.tiers, config.decode
    assert reuse.chunking.size == 64 and reuse.repair.mode == "none" and reuse.repair.selective_tokens == 4
    assert decode.speculative is None and tiers.remote_timeout_s == 0.5 and tiers.cache_bytes == 1000
    assert (tiers.kv_quant.host, tiers.kv_quant.disk, tiers.kv_quant.device) == ("int8", "int8", "none")
    assert decode.cuda_graphs is False
    # and nothing given: the defaults of the dataclasses
    assert split_options(engine_options(_engine_flags().parse_args([]))) == (LoadOptions(), EngineConfig())


def test_a_bad_value_or_unknown_name_is_refused_before_any_load():
    from engine import KVBoost

    with pytest.raises(TypeError, match="chunksize"):
        KVBoost.from_pretrained(chunksize=64)
    with pytest.raises(ValueError, match="weights must be one of"):
        KVBoost.from_pretrained(weights="int3")
    with pytest.raises(ValueError, match="device must be"):
        KVBoost.from_pretrained(device="gpu0")
    with pytest.raises(ValueError, match="group_size"):
        split_options({"group_size": 48})
    with pytest.raises(ValueError, match="chunk_size"):
        split_options({}, config=EngineConfig(reuse=ReuseConfig(chunking=ChunkingConfig(size=2))))


def test_options_apply_over_given_dataclasses(tmp_path):
    load, config = split_options({"chunk_size": 64, "disk_cache_dir": tmp_path},
                                 LoadOptions(weights="int4"), EngineConfig(reuse=ReuseConfig(mode="prefix")))
    assert load.weights == "int4" and config.reuse.mode == "prefix" and config.reuse.chunking.size == 64
    assert config.tiers.disk_cache_dir == str(tmp_path)


def test_with_options_changes_only_what_it_names_and_refuses_load_options(smollm):
    engine = smollm.with_options(selective_tokens=4, chunk_size=64)
    other = engine.with_options(repair="none")
    assert other.config.reuse.repair.mode == "none" and other.config.reuse.repair.selective_tokens == 4
    assert other.config.reuse.chunking.size == 64 and other.model is smollm.model
    with pytest.raises(ValueError, match="load options"):
        engine.with_options(weights="int4")
    with pytest.raises(TypeError, match="chunksize"):
        engine.with_options(chunksize=32)


def test_with_config_runs_the_same_model_under_another_config(smollm):
    config = dataclasses.replace(smollm.config, reuse=dataclasses.replace(smollm.config.reuse, mode="off"))
    engine = smollm.with_config(config)
    assert engine.config == config and engine.model is smollm.model
    messages = [{"role": "user", "content": "Name a colour."}]
    assert engine.chat(messages, max_new_tokens=6).text == smollm.chat(messages, max_new_tokens=6).text


def _with(config, path: tuple[str, ...], value):
    """`config` with the field at `path` (nested dataclasses) set to `value`, without its checks."""
    if len(path) == 1:
        return dataclasses.replace(config, **{path[0]: value})
    return dataclasses.replace(config, **{path[0]: _with(getattr(config, path[0]), path[1:], value)})


def _checked_options():
    from engine.config import SamplingConfig

    out = [(o.name, o.owner(), o.path, o.field.metadata) for o in options().values()
           if o.field.metadata.get("kind")]
    out += [(f.name, SamplingConfig(), (f.name,), f.metadata) for f in dataclasses.fields(SamplingConfig)
            if f.metadata.get("kind")]
    return out


@pytest.mark.parametrize("name, config, path, meta", _checked_options(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_declared_option_is_checked_by_its_kind_and_bounds_with_its_name(name, config, path, meta):
    config.validate()  # the defaults pass
    kind = meta["kind"]
    wrong = ["text", 1.5, None] if kind is int else ["text", True, None] if kind is float else [1, None]
    if kind is bool:
        wrong = [1, "yes", None]
    bounds = [meta["low"] - 1 if meta["low"] is not None else None,
              meta["above"] if meta["above"] is not None else None,
              meta["high"] + 1 if meta["high"] is not None else None]
    bad = [v for v in wrong if not (v is None and meta["optional"])] + [b for b in bounds if b is not None]
    if kind is float:
        bad.append(float("nan"))
    assert bad
    for value in bad:
        with pytest.raises(ValueError, match=rf"^{name} must be .*got {value!r}"):
            _with(config, path, value).validate()
    if meta["optional"]:
        _with(config, path, None).validate()
