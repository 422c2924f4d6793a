"""The shared tier's options without a store: from_pretrained, with_options, EngineConfig checks, the command
lines, a password never shown, a namespace per setting."""

from __future__ import annotations

import pytest
from tiny_models import build_model, build_tokenizer

from cli.kvboost import build_parser
from cli.server import build_server_parser
from engine import EngineConfig, KVBoost, TierConfig
from engine.kv.remote_tier import remote_namespace, shown_url


def test_the_namespace_follows_kv_quant_device_and_dtype():
    root = b"r" * 16
    base = remote_namespace(root, "none", "cpu", "torch.float32")
    assert base == remote_namespace(root, "none", "cpu", "torch.float32")
    others = [remote_namespace(b"s" * 16, "none", "cpu", "torch.float32"),
              remote_namespace(root, "int8", "cpu", "torch.float32"),
              remote_namespace(root, "none", "cuda", "torch.float32"),
              remote_namespace(root, "none", "cpu", "torch.bfloat16")]
    assert len({base, *others}) == 5


def test_from_pretrained_and_with_options_carry_the_remote_cache(tmp_path):
    model, tokenizer = build_model("llama"), build_tokenizer()
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # nothing listens on port 1: the engine loads all the same, the tier is just unavailable
    engine = KVBoost.from_pretrained(folder, device="cpu", chunk_size=16, disk_cache_bytes=0,
                                     remote_cache="redis://127.0.0.1:1/3", remote_timeout_s=0.02,
                                     remote_max_wait_s=3.0, remote_retry_s=7.0, remote_max_value_bytes=1 << 20)
    assert engine.config.tiers.remote_cache == "redis://127.0.0.1:1/3"
    other = engine.with_options(reuse="prefix")
    tiers = other.config.tiers
    assert (tiers.remote_cache, tiers.remote_timeout_s, tiers.remote_max_wait_s, tiers.remote_retry_s,
            tiers.remote_max_value_bytes) == \
        ("redis://127.0.0.1:1/3", 0.02, 3.0, 7.0, 1 << 20)
    tier = other.store.remote
    assert (tier.timeout_s, tier.max_wait_s, tier.max_value_bytes) == (0.02, 3.0, 1 << 20)
    # by default the limit on a value is one chunk's payload of this model (2 layers of 2 x 16 x 16 float32)
    default = engine.with_options(remote_max_value_bytes=None).store.remote.max_value_bytes
    assert 2 * 2 * 2 * 16 * 16 * 4 < default < 2 * 2 * 2 * 16 * 16 * 4 + (8 << 10)
    assert engine.with_options(remote_cache=None).store.remote is None
    result = engine.generate("w5 w6 w7 " * 40, max_new_tokens=3)
    assert result.stats.reused_by_tier == {}
    remote = engine.cache_stats().tiers.remote
    assert remote.errors == 1 and remote.state == "open"
    assert engine.memory().remote.state == "open"


@pytest.mark.parametrize("bad", ["http://host:6379", "127.0.0.1:6379", 6379])
def test_a_remote_cache_that_is_not_a_redis_url_is_refused(bad):
    with pytest.raises(ValueError, match="remote_cache"):
        EngineConfig(tiers=TierConfig(remote_cache=bad)).validate()


@pytest.mark.parametrize("options,named", [
    ({"remote_timeout_s": 0}, "remote_timeout_s"),
    ({"remote_max_wait_s": float("inf")}, "remote_max_wait_s"),
    ({"remote_timeout_s": 2.0, "remote_max_wait_s": 1.0}, r"remote_max_wait_s \(1.0\) must be at least"),
    ({"remote_max_value_bytes": 0}, "remote_max_value_bytes"),
    ({"remote_max_value_bytes": True}, "remote_max_value_bytes"),
])
def test_remote_timing_and_size_options_are_checked(options, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(tiers=TierConfig(remote_cache="redis://h/0", **options)).validate()


def test_the_password_is_never_shown():
    assert shown_url("redis://alice:s3cret@host:6380/2") == "redis://alice:***@host:6380/2"
    assert shown_url("rediss://:s3cret@host/0") == "rediss://:***@host/0"
    assert shown_url("redis://host:6379/0") == "redis://host:6379/0"
    with pytest.raises(ValueError) as info:
        EngineConfig(tiers=TierConfig(remote_cache="http://alice:s3cret@host")).validate()
    assert "s3cret" not in str(info.value)


def test_both_command_lines_take_remote_cache():
    args = build_parser().parse_args(["run", "hi", "--remote-cache", "redis://h:6379/1"])
    assert args.remote_cache == "redis://h:6379/1"
    assert build_parser().parse_args(["run", "hi"]).remote_cache is None
    assert build_server_parser().parse_args(["--remote-cache", "rediss://h/0"]).remote_cache == "rediss://h/0"
    stats = build_parser().parse_args(["cache", "stats", "--remote-cache", "redis://h/0"])
    assert stats.remote_cache == "redis://h/0"
    timing = build_server_parser().parse_args(["--remote-timeout", "0.5", "--remote-max-wait", "30"])
    assert (timing.remote_timeout_s, timing.remote_max_wait_s) == (0.5, 30.0)
    defaults = build_parser().parse_args(["run", "hi"])
    assert (defaults.remote_timeout_s, defaults.remote_max_wait_s) == \
        (TierConfig().remote_timeout_s, TierConfig().remote_max_wait_s)
