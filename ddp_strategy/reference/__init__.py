"""The reference model and data: scikit-learn's bundled digits, a small classifier, and the notebook's demos.

Owns: :class:`DigitsDataModule`, :class:`DigitsNet`/:class:`DigitsClassifier` and the plain-PyTorch demos of
:mod:`~ddp_strategy.reference.demo`. Must not touch: the strategy's internals (it uses only public names).
"""

from ddp_strategy.reference.data import DigitsDataModule, load_digits_tensors
from ddp_strategy.reference.model import DigitsClassifier, DigitsNet

__all__ = ["DigitsClassifier", "DigitsDataModule", "DigitsNet", "load_digits_tensors"]
