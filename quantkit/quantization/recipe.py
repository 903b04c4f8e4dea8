"""Recipes: versioned YAML files <-> typed dataclasses, validated at the edge.

A recipe says which modules are quantized (targets / ignore), how their weights are quantized
(a QuantScheme), with which algorithm, and optionally how the KV cache is quantized. A recipe is
named by the stem of a file in the built-in `recipes/` folder (e.g. "w4a16-rtn") or given as a path.

    version: 1
    description: INT4 weights, groups of 128, symmetric, round-to-nearest
    weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}
    targets: [Linear]          # "Linear" (every nn.Linear), exact module names, or "re:<regex>"
    ignore: [lm_head, score, classifier]  # same syntax; matched modules (and the linears inside them) stay
                               # in full precision. This list, the default, is the output head: it applies
                               # where it matches (DEFAULT_IGNORE); every other entry must match a module
    indivisible: smaller-group # a linear whose in_features the group size does not divide:
                               # smaller-group | channel | ragged | error (scheme.INDIVISIBLE)
    algorithm: {name: rtn}     # rtn | gptq | awq, with that algorithm's options
    kv_cache: null             # or {num_bits: 8, type: float, strategy: tensor}, optionally with
                               # rotation: hadamard (keys and values rotated by a Hadamard matrix of head_dim
                               # before the fp8 cache: quantkit.modules.kv_rotation)
    mix: null                  # with weights on grid q4_k: q4_k_m | q4_k_s, llama-quantize's per-tensor
                               # mixes (quantkit.gguf.mix: Q6_K / Q5_K for some v_proj and down_proj)
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..algorithms.registry import ALGORITHMS
from ..core.config_utils import ConfigError, from_dict
from ..core.errors import shorten
from ..core.scheme import INDIVISIBLE, QuantScheme, grid_scheme
from ..files.inputs import read_input_bytes
from ..gguf.mix import MIX_GRIDS, MixModel, mix_scheme
from ..modules.kv_rotation import ROTATIONS
from ..modules.targets import check_patterns, output_head_name, select_linears

RECIPE_VERSION = 1

#: The ignore list of every built-in recipe and of a recipe that gives none: the model's output head stays
#: float (a causal LM's lm_head, a classifier's score or classifier, and the module get_output_embeddings()
#: names, e.g. BertForMaskedLM's cls.predictions.decoder or Whisper's proj_out). Each entry applies where the
#: model has it; an ignore list other than this one is the user's own, and each of its entries must match.
DEFAULT_IGNORE = ("lm_head", "score", "classifier")


def _shown(value: Any) -> str:
    return f"{value!r} (a {type(value).__name__})"


@dataclass(frozen=True)
class AlgorithmConfig:
    """Algorithm name plus its typed options (e.g. GPTQ damping); options None: the algorithm's defaults."""

    name: str = "rtn"
    options: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in ALGORITHMS:
            raise ConfigError(f"unknown algorithm {_shown(self.name)}; available: {', '.join(sorted(ALGORITHMS))}")
        kind = ALGORITHMS[self.name].options
        if self.options is None:
            object.__setattr__(self, "options", kind())
        elif not isinstance(self.options, kind):
            raise ConfigError(f"algorithm {self.name!r}: options must be a {kind.__name__} (or None for its "
                              f"defaults), got {_shown(self.options)}")

    @property
    def needs_calibration(self) -> bool:
        """Whether the algorithm runs on calibration data (quantkit.algorithms.registry)."""
        return ALGORITHMS[self.name].needs_calibration

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name}
        if self.options is not None and dataclasses.is_dataclass(self.options):
            d.update(dataclasses.asdict(self.options))
        return d


@dataclass(frozen=True)
class Recipe:
    version: int = RECIPE_VERSION
    name: str = "custom"
    description: str = ""
    weights: QuantScheme | None = None
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    kv_cache: QuantScheme | None = None
    indivisible: str = "smaller-group"
    mix: str | None = None
    #: the kv_cache's `rotation` (quantkit.modules.kv_rotation.ROTATIONS): "none" or "hadamard"
    kv_cache_rotation: str = "none"

    def __post_init__(self) -> None:
        self._check_types()
        if self.indivisible not in INDIVISIBLE:
            raise ConfigError(f"indivisible must be one of {', '.join(INDIVISIBLE)}, got {self.indivisible!r}")
        if self.version != RECIPE_VERSION:
            raise ConfigError(f"recipe version {self.version} is not supported (this quantkit reads version {RECIPE_VERSION})")
        if self.weights is None and self.kv_cache is None:
            raise ConfigError("a recipe must quantize something: give `weights`, `kv_cache`, or both")
        if self.weights is not None and self.weights.type != "int":
            raise ConfigError("weights: only int weight schemes are supported (type: int)")
        if self.weights is not None and self.weights.actorder is not None:
            raise ConfigError("weights: actorder is recorded by the algorithm (gptq's act_order option), not set "
                              "in a recipe: remove it")
        if self.weights is not None and self.weights.strategy == "tensor":
            raise ConfigError("weights: strategy must be 'channel' or 'group' (per-tensor int weights are unsupported)")
        if self.kv_cache is not None and (self.kv_cache.type != "float" or self.kv_cache.strategy not in ("tensor",)):
            raise ConfigError("kv_cache: only fp8 per-tensor is supported: {num_bits: 8, type: float, strategy: tensor}")
        if not isinstance(self.kv_cache_rotation, str) or self.kv_cache_rotation not in ROTATIONS:
            raise ConfigError(f"kv_cache: rotation must be one of {', '.join(ROTATIONS)}, got "
                              f"{_shown(self.kv_cache_rotation)}")
        if self.kv_cache_rotation != "none" and self.kv_cache is None:
            raise ConfigError("kv_cache: a rotation needs an fp8 KV cache: {num_bits: 8, type: float, strategy: "
                              "tensor, rotation: hadamard}")
        if self.mix is not None:
            if self.mix not in MIX_GRIDS:
                raise ConfigError(f"mix must be one of {', '.join(MIX_GRIDS)} (or null), got {_shown(self.mix)}")
            grid = MIX_GRIDS[self.mix]
            if self.weights is None or self.weights.grid != grid:
                s = grid_scheme(grid)
                raise ConfigError(f"mix {self.mix} is llama.cpp's per-tensor mix around {grid.upper()}: it needs weights "
                                  f"on grid {grid} ({{num_bits: {s.num_bits}, symmetric: {str(s.symmetric).lower()}, "
                                  f"strategy: group, group_size: {s.group_size}, grid: {grid}}})")

    def _check_types(self) -> None:
        """ConfigError for a field of the wrong type, wherever the Recipe is built (YAML, a dict, Python): a
        list of patterns is kept as a tuple, a single string is refused (it is not split into characters)."""
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise ConfigError(f"version must be an integer, got {_shown(self.version)}")
        for key in ("name", "description", "indivisible"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"{key} must be a string, got {_shown(getattr(self, key))}")
        if self.mix is not None and not isinstance(self.mix, str):
            raise ConfigError(f"mix must be a string or null, got {_shown(self.mix)}")
        for key in ("weights", "kv_cache"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), QuantScheme):
                raise ConfigError(f"{key} must be a QuantScheme or None, got {_shown(getattr(self, key))}")
        for key in ("targets", "ignore"):
            value = getattr(self, key)
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
                    isinstance(v, str) and v for v in value):
                example = f"({value!r},)" if isinstance(value, str) else "('Linear',)"
                raise ConfigError(f"{key} must be a list or tuple of module names or patterns (non-empty strings), "
                                  f"e.g. {example}, got {_shown(value)}")
            object.__setattr__(self, key, tuple(value))
            check_patterns(value, key)
        if not isinstance(self.algorithm, AlgorithmConfig):
            hint = f" (e.g. AlgorithmConfig({self.algorithm!r}))" if isinstance(self.algorithm, str) else ""
            raise ConfigError(f"algorithm must be an AlgorithmConfig{hint}, got {_shown(self.algorithm)}")

    def linears(self, model) -> tuple[list[str], list[str]]:
        """(targeted, left float) nn.Linear names of `model` (targets.select_linears); the default ignore list
        (DEFAULT_IGNORE and the model's output embeddings) applies where it matches."""
        if self.ignore != DEFAULT_IGNORE:
            return select_linears(model, self.targets, self.ignore)
        head = output_head_name(model)
        return select_linears(model, self.targets, (), optional_ignore=self.ignore + ((head,) if head else ()))

    def weights_for(self, in_features: int, name: str | None = None, model=None) -> QuantScheme:
        """The weight scheme of a targeted linear with `in_features` inputs (the `indivisible` rule applied);
        ValueError when the rule is "error" and the group size does not divide in_features. With a `mix`,
        the linear's module path `name` and the model (gguf_mix.MixModel) choose its grid first."""
        assert self.weights is not None
        if self.mix is not None:
            if name is None or model is None:
                raise ValueError(f"recipe {self.name}: mix {self.mix} chooses each linear's grid by its name and layer")
            return mix_scheme(self.mix, name, in_features, model, self.indivisible)
        return self.weights.fitted(in_features, self.indivisible)

    def schemes_for(self, model, names) -> dict[str, QuantScheme]:
        """Module path -> weight scheme of each of `model`'s linears `names` (weights_for of each; the mix
        reads the model's config). ValueError naming the linear a scheme cannot be fitted to."""
        mix_model = None
        if self.mix is not None:
            mix_model = MixModel.of(model.config)
        schemes = {}
        for name in names:
            k = model.get_submodule(name).in_features
            try:
                schemes[name] = self.weights_for(k, name, mix_model)
            except ValueError as e:
                raise ValueError(f"{name} (in_features={k}): {e}") from None
        return schemes

    @property
    def needs_calibration(self) -> bool:
        """Whether quantizing with this recipe needs calibration data (a calibrated algorithm or an FP8 KV cache)."""
        return self.kv_cache is not None or (self.weights is not None and self.algorithm.needs_calibration)

    def to_dict(self) -> dict[str, Any]:
        def scheme(s: QuantScheme | None):
            if s is None:
                return None
            d = dataclasses.asdict(s)
            return {k: v for k, v in d.items()
                    if not (k in ("group_size", "actorder") and v is None) and not (k == "grid" and v == "uniform")}

        kv_cache = scheme(self.kv_cache)
        if kv_cache is not None and self.kv_cache_rotation != "none":
            kv_cache["rotation"] = self.kv_cache_rotation
        return {
            "version": self.version,
            "description": self.description,
            "weights": scheme(self.weights),
            "targets": list(self.targets),
            "ignore": list(self.ignore),
            "algorithm": self.algorithm.to_dict(),
            "kv_cache": kv_cache,
            "indivisible": self.indivisible,
            **({"mix": self.mix} if self.mix is not None else {}),
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _string_list(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
    return tuple(value)


def _algorithm(data: Any, where: str) -> AlgorithmConfig:
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict) or "name" not in data:
        raise ConfigError(f"{where}: expected {{name: <algorithm>, ...options}}, got {data!r}")
    name = data["name"]
    if name not in ALGORITHMS:
        raise ConfigError(f"{where}: unknown algorithm {name!r}; available: {', '.join(sorted(ALGORITHMS))}")
    options = from_dict(ALGORITHMS[name].options, {k: v for k, v in data.items() if k != "name"}, f"{where} ({name})")
    return AlgorithmConfig(name=name, options=options)


def recipe_from_dict(data: Any, name: str = "custom") -> Recipe:
    where = f"recipe {name!r}"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a YAML mapping at the top level")
    allowed = {f.name for f in dataclasses.fields(Recipe)} - {"name", "kv_cache_rotation"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        # Reuse from_dict's message (with suggestions) for the unknown keys.
        from_dict(Recipe, {k: data[k] for k in unknown}, where)
    kwargs: dict[str, Any] = {"name": name}
    for key in ("version", "description", "indivisible", "mix"):
        if key in data:
            kwargs[key] = data[key]
    for key in ("weights", "kv_cache"):
        if data.get(key) is not None:
            value = data[key]
            if key == "kv_cache" and isinstance(value, dict) and "rotation" in value:
                value = dict(value)
                kwargs["kv_cache_rotation"] = value.pop("rotation")  # quantkit's, not compressed-tensors'
            kwargs[key] = from_dict(QuantScheme, value, f"{where}: {key}")
    for key in ("targets", "ignore"):
        if key in data:
            kwargs[key] = _string_list(data[key] or [], f"{where}: {key}")
            check_patterns(kwargs[key], f"{where}: {key}")
    kwargs["algorithm"] = _algorithm(data.get("algorithm", "rtn"), f"{where}: algorithm")
    try:
        return Recipe(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def builtin_recipes() -> dict[str, Path]:
    """Stem -> path of every recipe shipped in quantkit.recipes."""
    folder = importlib.resources.files("quantkit.recipes")
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith((".yaml", ".yml"))}


def load_recipe(recipe: "str | Path | Recipe | dict") -> Recipe:
    """A Recipe from a built-in name, a YAML path, a dict, or a Recipe (returned as is)."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict):
        return recipe_from_dict(recipe)
    builtins = builtin_recipes()
    path = Path(recipe)
    if str(recipe) in builtins:
        path = builtins[str(recipe)]
    elif not path.is_file():
        raise ConfigError(
            f"recipe {shorten(repr(str(recipe)), 400)} is neither a built-in recipe nor a YAML file; "
            f"built-in recipes: {', '.join(sorted(builtins))}"
        )
    return recipe_from_dict(read_recipe_yaml(path), name=path.stem)


#: Recipes are a few hundred bytes (a long ignore list a few KiB); a file beyond this is not one.
MAX_RECIPE_BYTES = 64 << 10


#: How deep a recipe's values may nest (a recipe needs 3 levels; thousands exhaust Python's stack).
MAX_RECIPE_DEPTH = 32


class _NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases (`*name`: a few nested aliases expand to billions of values),
    values nested deeper than MAX_RECIPE_DEPTH and a key given twice in one mapping (YAML 1.2 forbids it;
    PyYAML would keep the last value, silently)."""

    depth = 0

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: the constructor names it below
                    continue
                if first is not key_node.start_mark:
                    mark = key_node.start_mark
                    raise ConfigError(f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: the key "
                                      f"{key!r} is given twice in one mapping (first at line {first.line + 1}, "
                                      f"column {first.column + 1}); give each key once")
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            raise ConfigError(f"{mark.name}, line {mark.line + 1}: recipes do not use YAML aliases (*name); "
                              f"write the value out")
        if self.depth >= MAX_RECIPE_DEPTH:
            raise ConfigError(f"{mark.name}, line {mark.line + 1}: values nested more than {MAX_RECIPE_DEPTH} "
                              f"levels deep; a recipe is a few flat settings")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def read_recipe_yaml(path: Path):
    """The YAML data of a recipe file (UTF-8, or UTF-16 with a byte-order mark); ConfigError for a file over
    MAX_RECIPE_BYTES, text in another encoding, invalid YAML, an alias or values nested too deep."""
    raw = read_input_bytes(path, "recipe file", MAX_RECIPE_BYTES, ConfigError)
    loader = None
    try:
        loader = _NoAliasLoader(raw)  # decodes the first bytes already
        loader.name = str(path)  # messages name the file
        return loader.get_single_data()
    except yaml.reader.ReaderError as e:
        raise ConfigError(f"recipe file {path} cannot be read as text ({e.reason} at byte {e.position}); "
                          f"save it as UTF-8 text") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe file {path} is not valid YAML: {_yaml_problem(e)}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one clause: what is wrong, where (line, column), and the fix for the usual mistakes."""
    problem = getattr(e, "problem", None) or str(e)
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    if "expected a single document" in f"{problem} {getattr(e, 'context', None)}":
        return (f"it holds more than one YAML document (another starts{where.replace(' (', ' at ').rstrip(')')}); a "
                f"recipe is one document: remove the second '---' and what follows, or merge them")
    if "'\\t'" in problem or "\t" in problem:
        return f"{problem}{where}: indent with spaces, not tabs"
    context = getattr(e, "context", None)
    return f"{problem}{where}" + (f", {context}" if context else "")
