"""The model speed is timed on: sized from the last-level cache, read from a (fake) /sys."""

from quantkit.harness.roofline import ModelShape, RooflineScheme, decoder_weight_bytes
from quantkit.harness.speed_model import CACHE_MULTIPLE, MAX_FLOAT32_BYTES, bandwidth_bound_config, last_level_cache


def _cache(root, cpu, index, level, kind, size, shared):
    folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (folder / name).write_text(f"{value}\n")


def test_last_level_cache_is_the_highest_level_over_its_instances(tmp_path):
    for cpu in range(4):  # two L3 instances of 16 MiB (cores 0-1 and 2-3), private L2, an instruction cache
        _cache(tmp_path, cpu, 0, 1, "Instruction", "32K", str(cpu))
        _cache(tmp_path, cpu, 2, 2, "Unified", "512K", str(cpu))
        _cache(tmp_path, cpu, 3, 3, "Unified", "16384K", "0-1" if cpu < 2 else "2-3")
    cache = last_level_cache(tmp_path)
    assert cache.bytes == 32 << 20 and cache.source.startswith("L3, 2 x 16 MiB")
    assert last_level_cache(tmp_path / "missing").source.startswith("assumed 32 MiB")


def test_even_the_smallest_variant_exceeds_the_cache():
    w4 = RooflineScheme("w4g128", 4, 128, scale_bytes=2)
    for cache in (64 << 10, 8 << 20, 32 << 20):
        config = bandwidth_bound_config(cache)
        shape = ModelShape.from_config(config)
        assert decoder_weight_bytes(shape, w4) >= CACHE_MULTIPLE * cache * 0.99, cache
        assert config["intermediate_size"] % 128 == 0 and config["hidden_size"] % 128 == 0
    # a 32 MiB L3: 0.14 B parameters, about 0.5 GiB of float32 decoder weights
    big = ModelShape.from_config(bandwidth_bound_config(32 << 20))
    assert 4 * 2**30 > decoder_weight_bytes(big, RooflineScheme("fp32", 32)) > 16 * (32 << 20)
    # a huge cache: float32 weights capped (the demo reports the multiples it got)
    huge = ModelShape.from_config(bandwidth_bound_config(1 << 30))
    assert 0.9 * MAX_FLOAT32_BYTES < decoder_weight_bytes(huge, RooflineScheme("fp32", 32)) <= MAX_FLOAT32_BYTES
