"""pilotrun.train: the training loop, precision, checkpoints, the run record, timing, distribution.

This package object is also callable, `pilotrun.train(config, data=..., run_dir=...)` (pilotrun/api.py's
`train`): Python binds a parent package's attribute `train` to this subpackage as soon as any
`pilotrun.train.*` module is imported, so the notebook API's `pilotrun.train` can only be this object.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from pilotrun.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
