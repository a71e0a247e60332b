"""Maps the fixed top-level folders onto the `polynya` import package.

core/ -> polynya, kernels/ -> polynya.kernels, adapters/ -> polynya.adapters,
recipes/ -> polynya.recipes. Subpackages are discovered by walking each folder, so a new
room only needs an ``__init__.py``. Everything else lives in pyproject.toml.
"""
import os

from setuptools import setup

ROOTS = {
    "polynya": "core",
    "polynya.kernels": "kernels",
    "polynya.adapters": "adapters",
    "polynya.recipes": "recipes",
}


def _packages() -> list[str]:
    found = []
    for pkg, root in ROOTS.items():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, root)
                found.append(pkg if rel == "." else pkg + "." + rel.replace(os.sep, "."))
    return found


setup(
    packages=_packages(),
    package_dir=ROOTS,
    package_data={"polynya.recipes": ["conf/**/*.yaml", "data/**/*"],
                  "polynya.adapters": ["verl/config/**/*.yaml"]},
    include_package_data=True,
)
