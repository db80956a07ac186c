"""The folders of jdp are its layers, and imports run downward only: a lower layer never
imports a higher one, so the layout a newcomer reads is the architecture."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jdp"

# Bottom to top. A module may import its own layer and those before it. The programs
# at the top (the dry run, the report, sampling, text preparation, the export, the benchmarks,
# main, and the tuner above main) stand on everything below them and on nothing of
# each other but as listed.
LAYERS = [
    ("jdp", "jdp.errors"),  # the package root: the mesh axis names, ConfigError
    ("jdp.runtime",),
    ("jdp.models",),
    ("jdp.config",),
    ("jdp.data",),
    ("jdp.experiment", "jdp.task"),
    ("jdp.parallel",),
    ("jdp.checkpoint", "jdp.observe"),
    ("jdp.train",),
    ("jdp.trained_run",),  # a run read from its workdir, for the programs that use it
    # jdp.hooks, the experiments' import, also offers the trackers, which send the report's
    # plots.
    ("jdp.dryrun", "jdp.report", "jdp.sample", "jdp.text", "jdp.evaluate", "jdp.export",
     "jdp.track", "jdp.hooks"),
    ("jdp.bench", "jdp.main"),
    ("jdp.tune",),  # runs jdp.main's trainer for its trials
]


def layer_of(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "jdp" and module.startswith(prefix + ".")):
                best = index
    if best is None and module.startswith("jdp"):
        pytest.fail(f"{module} belongs to no layer of tests/test_layers.py")
    return best


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def jdp_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jdp"):
            found += [node.module] if node.module != "jdp" else [
                f"jdp.{alias.name}" if (PACKAGE / alias.name).exists()
                or (PACKAGE / f"{alias.name}.py").exists() else "jdp"
                for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("jdp")]
    return found


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        own = layer_of(module)
        upward += [f"{module} (layer {own}) imports {imported} (layer {layer_of(imported)})"
                   for imported in jdp_imports(path) if layer_of(imported) > own]
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import():
    assert layer_of("jdp.parallel.step") < layer_of("jdp.train.loop")
    assert layer_of("jdp.data.text.lm") == layer_of("jdp.data")
