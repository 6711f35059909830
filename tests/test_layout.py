"""The test tree must not hide installed modules. pytest puts tests/ on sys.path, so a package
tests/<name>/ (with __init__.py) shadows an installed top-level module <name> for every library that
imports it: transformers 5.25 imports the `kernels` distribution at start-up, and tests/kernels, a
package until then, broke the collection of every test that loads transformers. tests/kernels/ is a
plain folder now (its module names are unique), and tests/draft/ and tests/engines/ must stay clear
of installed names."""

import importlib.metadata
from pathlib import Path


def test_no_test_package_shadows_an_installed_module():
    packages = {init.parent.name for init in Path(__file__).parent.glob("*/__init__.py")}
    installed = set(importlib.metadata.packages_distributions())
    assert packages, "tests/draft and tests/engines are packages: the check must see them"
    assert not packages & installed, f"test packages shadow installed modules: {sorted(packages & installed)}"
