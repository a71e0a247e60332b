"""``polynya-recipe`` / ``python -m polynya.recipes``: run a Hydra recipe.

    polynya-recipe                                   # toy task, tiny model, CPU, ~1 minute
    polynya-recipe task=gsm8k model=qwen3-0.6b placement=colocated run.steps=200
"""
from __future__ import annotations

import os

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/polynya/torch_extensions"))


def main() -> None:
    import sys

    import hydra

    from .schema import check_overrides, register

    try:
        check_overrides(sys.argv[1:])
    except ValueError as exc:
        raise SystemExit(f"polynya-recipe: {exc}") from None
    register()

    @hydra.main(config_path="conf", config_name="config", version_base=None)
    def _app(cfg) -> None:
        from .frameworks import run

        run(cfg)

    _app()


if __name__ == "__main__":
    main()
