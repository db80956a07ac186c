"""jdp reaches into jax._src in one module only, jax_compat, so a jax that moves those
internals breaks one place, with a message that says what to do."""

import ast
import pathlib

import jax

import jdp

PACKAGE = pathlib.Path(jdp.__file__).parent


def _private_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("jax._src")]
    return found


def test_only_jax_compat_imports_jax_src():
    offenders = {str(path.relative_to(PACKAGE)): _private_imports(path)
                 for path in PACKAGE.rglob("*.py") if path.name != "jax_compat.py"}
    assert {path: mods for path, mods in offenders.items() if mods} == {}
    # The one place, so the test bites.
    assert _private_imports(PACKAGE / "runtime" / "jax_compat.py")


def test_the_private_pieces_jdp_needs_are_there():
    from jdp.runtime import jax_compat

    assert jax_compat.cluster_types()
    state = jax_compat.distributed_state()
    assert hasattr(state, "client") and hasattr(state, "process_id")


def test_backends_count_as_started_once_jax_has_devices():
    from jdp.runtime import jax_compat

    jax.devices()
    assert jax_compat.backends_initialized()

