"""``python -m dflash2_lightning fit --config configs/tiny.yaml``: the same CLI as the ``dflash2`` script."""

from dflash2_lightning.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
