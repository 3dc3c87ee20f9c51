"""The import rules between the three packages, read from the source with ``ast``.

``pallas_kernels/`` ships kernels and imports nothing from ``jaxinfer`` (nor ``sharding``);
``sharding/`` sits below ``jaxinfer`` and may import from it only the model's declared types.
An import inside a function counts as much as one at the top of a file.
"""

import ast
from pathlib import Path

from tests.conftest import REPO

# What sharding/ may import from jaxinfer: the declarations of the model, its weights (and the
# quantized weight leaf), its cache and a loaded model (not the engine, the runner or the loaders).
SHARDING_MAY_IMPORT = ("jaxinfer.config", "jaxinfer.params", "jaxinfer.quantization", "jaxinfer.kv_cache",
                       "jaxinfer.loaded_model")


def imported_modules(path: Path) -> set[str]:
    """Every absolute name a file imports: ``import a.b`` gives ``a.b``, ``from a.b import c`` ``a.b.c``."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def imports_of_package(package: str) -> dict[str, set[str]]:
    return {str(path.relative_to(REPO)): imported_modules(path) for path in sorted((REPO / package).rglob("*.py"))}


def top_level(module: str) -> str:
    return module.split(".")[0]


def test_imported_modules_reads_every_kind_of_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os.path\nfrom jaxinfer import engine\nfrom . import sibling\n"
                      "def f():\n    from jaxinfer.params import Weights\n")
    assert imported_modules(source) == {"os.path", "jaxinfer.engine", "jaxinfer.params.Weights"}


def test_pallas_kernels_import_nothing_from_jaxinfer_or_sharding():
    offenders = {path: sorted(m for m in modules if top_level(m) in ("jaxinfer", "sharding"))
                 for path, modules in imports_of_package("pallas_kernels").items()}
    assert {path: found for path, found in offenders.items() if found} == {}


def test_sharding_imports_only_the_model_types_from_jaxinfer():
    def allowed(module: str) -> bool:  # ``jaxinfer.params.Weights`` is inside ``jaxinfer.params``
        return any(module == m or module.startswith(m + ".") for m in SHARDING_MAY_IMPORT)

    offenders = {path: sorted(m for m in modules if top_level(m) == "jaxinfer" and not allowed(m))
                 for path, modules in imports_of_package("sharding").items()}
    assert {path: found for path, found in offenders.items() if found} == {}
