"""Every use of Lightning's or PyTorch's private API, per namespace and version, with guard tests.

Owns: which Lightning namespace is used (:mod:`~ddp_strategy._compat.namespace`), Lightning's private names
(:mod:`~ddp_strategy._compat.lightning_private`, guarded by tests/_compat/test_lightning_private.py) and
PyTorch's (:mod:`~ddp_strategy._compat.torch_private`, guarded by tests/_compat/test_torch_private.py).
Must not import any other part of the package.
"""
