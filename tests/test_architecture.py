"""The package's import graph: no cycles, and no arrow pointing from a floor to a floor above it.

Read from the source with `ast` (every import statement, including those inside functions), so the
rules hold whatever a test run happens to import. The floors, from the bottom: kernels (torch and
triton only) -> core -> files -> modules / algorithms -> runtime -> formats / gguf -> quantization ->
calibration -> api -> harness -> commands (see ARCHITECTURE.md).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the import name it ships as (pyproject's package-dir)
PACKAGE_DIRS = {"quantkit": "quantkit"}

#: The floors, from the bottom: each a tuple of module prefixes. A module stands on the floor of the longest
#: prefix that names it, and imports only from its own floor or the floors below it.
FLOORS = (
    # torch and triton only; `quantkit` itself (its public names are imported on first use, by importlib)
    ("quantkit.kernels",),
    # errors, parsing, devices, the quantization vocabulary; the GGUF type records, byte layouts, llama.cpp's
    # reference quantizers and grids, which import nothing of quantkit above them
    ("quantkit.core", "quantkit.gguf.types", "quantkit.gguf.blocks", "quantkit.gguf.reference_quants",
     "quantkit.gguf.grids"),
    # input and output files; the built-in reference models (their store writes through files.outputs)
    ("quantkit.files", "quantkit.refmodels"),
    # the torch modules quantkit puts in a model (the GGUF-block layer among them), and the surgery that puts them
    # there; the pure algorithms
    ("quantkit.modules", "quantkit.gguf.linear", "quantkit.algorithms"),
    # the C++ decode loop, sampling and the CPU model's generate
    ("quantkit.runtime",),
    # what is on disk: compressed-tensors and safetensors, model folders, everything GGUF above its grids
    ("quantkit.formats", "quantkit.gguf"),
    # recipes, provenance, the weight census and its summaries
    ("quantkit.quantization",),
    ("quantkit.calibration",),
    # quantize / save / load
    ("quantkit.api",),
    ("quantkit.harness",),
    ("quantkit.commands", "quantkit.__main__"),
)

#: importer prefix -> imported prefixes it must not reach, although no floor forbids it
FORBIDDEN = {
    # the algorithms are pure functions of tensors: no modules, no files
    "quantkit.algorithms": ("quantkit.formats", "quantkit.modules", "quantkit.files"),
    # engine adapters translate to the kernels' contract and nothing else
    "quantkit.engines": tuple(prefix for floor in FLOORS[1:] for prefix in floor),
}


def floor_of(module: str) -> int | None:
    """The index in FLOORS of the longest prefix naming `module`; 0 for the package `quantkit` itself (its
    names are imported on first use), None for a module on no floor (the engine adapters)."""
    if module == "quantkit":
        return 0
    best, floor = "", None
    for index, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if _under(module, prefix) and len(prefix) > len(best):
                best, floor = prefix, index
    return floor


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points to a higher floor or that FORBIDDEN names, as 'A imports B'."""
    wrong = []
    for importer, targets in graph.items():
        for imported in targets:
            low, high = floor_of(importer), floor_of(imported)
            if low is not None and high is not None and high > low:
                wrong.append(f"{importer} imports {imported} (floor {low} -> {high})")
            elif any(_under(importer, layer) and any(_under(imported, f) for f in forbidden)
                     for layer, forbidden in FORBIDDEN.items()):
                wrong.append(f"{importer} imports {imported}")
    return sorted(wrong)


def module_files() -> dict[str, Path]:
    """Import name -> source file of every module of the package."""
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of the package's modules (None: a third-party import)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports. `from P import name` counts as an import of P.name when
    that is a module, else of P."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    parent = ".".join(base + ([node.module] if node.module else []))
                else:
                    parent = node.module or ""
                names = [f"{parent}.{a.name}" if f"{parent}.{a.name}" in modules else parent for a in node.names]
            for name in names:
                known = _known(name, modules)
                if known and known != module:
                    targets.add(known)
        graph[module] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert {"quantkit.api", "quantkit.kernels.wna16", "quantkit.modules.quant_linear"} <= set(graph)
    assert "quantkit.modules.model_kernels" in graph["quantkit.api"]
    assert "quantkit.kernels.packing" in graph["quantkit.kernels.reference"]  # relative imports resolve


def test_no_import_cycles():
    assert find_cycles(import_graph()) == []


def test_every_module_stands_on_a_floor():
    assert sorted(m for m in import_graph() if floor_of(m) is None and not _under(m, "quantkit.engines")) == []


def test_no_wrong_way_arrows():
    assert upward_imports(import_graph()) == []


def test_every_package_ships():
    """Each folder of the package is in pyproject.toml's `packages` (a wheel holds only those)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(("quantkit", *p.parent.relative_to(ROOT / "quantkit").parts))
               for p in (ROOT / "quantkit").rglob("__init__.py")}
    assert sorted(folders - listed) == []


def test_engine_adapters_are_loaded_by_their_engines_only():
    """quantkit.engines.* import their engine (vLLM, ...): nothing else in quantkit may import them, so
    that `import quantkit` never needs an engine installed (the engines load them through entry points)."""
    graph = import_graph()
    assert "quantkit.engines.vllm_wna16" in graph
    importers = sorted(
        importer for importer, targets in graph.items()
        if not _under(importer, "quantkit.engines") and any(_under(t, "quantkit.engines") for t in targets)
    )
    assert importers == []


def test_the_checks_can_fail():
    """The cycle finder and the floor rules catch what they are for, on a made-up graph."""
    graph = {"quantkit.quantization.recipe": {"quantkit.algorithms"},
             "quantkit.algorithms": {"quantkit.quantization.recipe"},
             "quantkit.modules.kv_cache": {"quantkit.calibration.kv_scales"}, "quantkit.calibration.kv_scales": set(),
             "quantkit.core.scheme": {"quantkit.gguf.types", "quantkit.gguf.mix"},
             "quantkit.gguf.types": set(), "quantkit.gguf.mix": set(),
             "quantkit.algorithms.rtn": {"quantkit.modules.quant_linear"}, "quantkit.modules.quant_linear": set()}
    assert find_cycles(graph) == [["quantkit.algorithms", "quantkit.quantization.recipe"]]
    assert upward_imports(graph) == [
        "quantkit.algorithms imports quantkit.quantization.recipe (floor 3 -> 6)",
        "quantkit.algorithms.rtn imports quantkit.modules.quant_linear",
        "quantkit.core.scheme imports quantkit.gguf.mix (floor 1 -> 5)",
        "quantkit.modules.kv_cache imports quantkit.calibration.kv_scales (floor 3 -> 7)",
    ]
