"""Fused Triton kernels for Wiola. Each ``kernels/<op>.py`` computes exactly what the
reference function of the same name in ``wiola/ops`` computes, forward and backward.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU tensors.

The conventions every kernel module follows (launch configs, the interpreter rule, the SM count,
allocation, input checks) are in ``_utils``; the ahead-of-time builds in ``aot/``. Attention keeps
its Triton code (``attention_triton``) apart from its launchers and op (``attention``).
"""

if __name__ == "kernels":
    # This folder is the `wiola_kernels` package (docs/SPEC.md, "Package names"). Imported as
    # `kernels`, it was found through a checkout's root on sys.path (pytest's `pythonpath`,
    # `python -m wiola` run from the root) by code that wants Hugging Face's `kernels` (transformers
    # imports it). A module may replace itself in sys.modules while it is imported: this one hands
    # over Hugging Face's package where it is installed, and otherwise an empty namespace package,
    # what Python gives for a folder on sys.path that is not a package (transformers then finds no
    # `kernels` installed: no file, no version).
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    # The root and this file by their real paths: the root may be on sys.path twice, once through
    # a symbolic link, and finding this file again would import it again, without end.
    _me = _os.path.realpath(__file__)
    _root = _os.path.dirname(_os.path.dirname(_me))
    _path = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _root]
    _spec = None
    for _finder in _sys.meta_path:  # an editable install's finder, then sys.path without the root
        _find = getattr(_finder, "find_spec", None)
        _spec = _find("kernels", _path if _finder is _machinery.PathFinder else None) if _find else None
        if _spec is not None and _spec.loader is not None and _os.path.realpath(_spec.origin or "") != _me:
            break
        _spec = None
    if _spec is None:
        _spec = _machinery.ModuleSpec("kernels", None, is_package=True)
        _spec.submodule_search_locations = []
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module
    if _spec.loader is not None:
        _spec.loader.exec_module(_module)
