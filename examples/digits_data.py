"""The handwritten digits scikit-learn ships (1797 8x8 images), read from its package's data file without importing
scikit-learn: its import costs about 2 s of CPU in every process, more than these examples' whole training. The arrays
are those of `sklearn.datasets.load_digits()`, bit for bit."""

import gzip
import importlib.util
import os
from types import SimpleNamespace

import numpy as np


def load_digits(return_X_y=False):
    package = os.path.dirname(importlib.util.find_spec("sklearn").origin)
    with gzip.open(os.path.join(package, "datasets", "data", "digits.csv.gz")) as f:
        table = np.loadtxt(f, delimiter=",")
    data, target = table[:, :-1], table[:, -1].astype(int, copy=False)
    if return_X_y:
        return data, target
    return SimpleNamespace(data=data, target=target, images=data.reshape(-1, 8, 8))
