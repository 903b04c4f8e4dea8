import pytest

from quantkit.core.errors import ConfigError
from quantkit.quantization.recipe import builtin_recipes, load_recipe
from quantkit.core.scheme import QuantScheme


def test_builtin_recipes():
    names = builtin_recipes()
    for name in ("w8a16-rtn", "w4a16-rtn", "w4a16-rtn-asym"):
        assert name in names
    assert load_recipe("w8a16-rtn").weights == QuantScheme(num_bits=8, strategy="channel")
    r = load_recipe("w4a16-rtn-asym")
    assert r.weights == QuantScheme(num_bits=4, strategy="group", group_size=128, symmetric=False)
    assert r.ignore == ("lm_head", "score", "classifier") and r.algorithm.name == "rtn"


def test_every_builtin_recipe_loads_and_round_trips():
    import yaml

    from quantkit.quantization.recipe import recipe_from_dict

    for name in builtin_recipes():
        recipe = load_recipe(name)
        assert recipe_from_dict(yaml.safe_load(recipe.to_yaml()), name=name) == recipe


def test_recipe_from_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("version: 1\nweights: {num_bits: 4, strategy: group, group_size: 64}\nignore: []\n")
    recipe = load_recipe(str(path))
    assert recipe.name == "mine" and recipe.weights.group_size == 64 and recipe.ignore == ()


@pytest.mark.parametrize("text, message", [
    ("version: 1\nweigths: {num_bits: 4}\n", r"unknown key\(s\) 'weigths' \(did you mean 'weights'\?\).*allowed keys"),
    ("version: 1\nweights: {num_bits: 4, strategy: group, group_size: 128, grp: 3}\n", "unknown key.*'grp'.*allowed keys: num_bits"),
    ("version: 1\nweights: {num_bits: 5, strategy: channel}\n", "num_bits must be one of"),
    ("version: 1\nweights: {num_bits: 4, strategy: group, group_size: 100}\n", "group_size must be one of"),
    ("version: 1\nweights: {num_bits: 4, strategy: channel}\nalgorithm: {name: magic}\n", "unknown algorithm 'magic'; available: "),
    ("version: 2\nweights: {num_bits: 4, strategy: channel}\n", "version 2 is not supported"),
    ("version: 1\n", "must quantize something"),
    ("- a\n- b\n", "mapping"),
])
def test_bad_recipes_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_recipe(str(path))


def test_unknown_recipe_lists_builtins():
    with pytest.raises(ConfigError, match="built-in recipes: .*w4a16-rtn"):
        load_recipe("w3a16-nope")


def test_algorithm_registry_answers_what_callers_ask():
    from quantkit.algorithms.registry import ALGORITHMS
    from quantkit.calibration import make_processor

    assert set(ALGORITHMS) == {"rtn", "gptq", "awq", "autoround"}
    for name, algorithm in ALGORITHMS.items():
        recipe = load_recipe({"weights": {"num_bits": 4, "strategy": "channel"}, "algorithm": {"name": name}})
        assert isinstance(recipe.algorithm.options, algorithm.options)
        assert recipe.needs_calibration == algorithm.needs_calibration == (algorithm.processor is not None)
        if algorithm.needs_calibration:
            processor = make_processor(recipe, {})
            assert type(processor).__name__ == algorithm.processor.rsplit(":", 1)[1]
            assert processor.options is recipe.algorithm.options and callable(processor.process_block)
    assert load_recipe("kv-fp8").needs_calibration and not load_recipe("w4a16-rtn").needs_calibration
