"""eqpar: Equinox-based functional parallelism for JAX."""

from . import collectives as collectives
from . import nn as nn
from . import placement as placement
from . import ragged as ragged
from ._paths import leaf_paths as leaf_paths
from ._typing import DeclaresPartitionSpecs as DeclaresPartitionSpecs

__version__ = "0.1.0"
