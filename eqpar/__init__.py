"""eqpar: Equinox-based functional parallelism for JAX.

Data, FSDP, tensor and pipeline parallelism for ordinary Equinox models, composed on one
device mesh. The submodules `collectives`, `ragged`, `placement`, `pipeline`, `schedule`,
`checkpoint`, `inspect` and `nn` hold the building blocks; the names below are the ones most
code imports.
"""

from . import checkpoint as checkpoint
from . import collectives as collectives
from . import context as context
from . import inspect as inspect
from . import nn as nn
from . import pipeline as pipeline
from . import placement as placement
from . import planning as planning
from . import precision as precision
from . import ragged as ragged
from . import schedule as schedule
from ._paths import leaf_paths as leaf_paths
from ._typing import DeclaresPartitionSpecs as DeclaresPartitionSpecs
from .distributions import DEFAULT_FSDP_MIN_SIZE_BYTES as DEFAULT_FSDP_MIN_SIZE_BYTES
from .distributions import FSDP as FSDP
from .distributions import DataParallel as DataParallel
from .distributions import Distribution as Distribution
from .distributions import ModelParallel as ModelParallel
from .distributions import build_model as build_model
from .distributions import distribute_input as distribute_input
from .distributions import distribute_model as distribute_model
from .distributions import distribute_opt_state as distribute_opt_state
from .distributions import distribution as distribution
from .distributions import fsdp_spec as fsdp_spec
from .distributions import set_distribution as set_distribution
from .layout import LayoutMap as LayoutMap
from .layout import TensorLayout as TensorLayout
from .layout import named_shardings as named_shardings
from .layout import partition_specs as partition_specs
from .mesh import DeviceMesh as DeviceMesh
from .mesh import list_devices as list_devices
from .nn.pipelined import value_and_grad as value_and_grad
from .parity import CheckReport as CheckReport
from .parity import ParityError as ParityError
from .parity import check as check
from .plan import ColumnParallel as ColumnParallel
from .plan import ContextParallel as ContextParallel
from .plan import ExpertParallel as ExpertParallel
from .plan import FeatureParallel as FeatureParallel
from .plan import HeadParallel as HeadParallel
from .plan import Pipeline as Pipeline
from .plan import Remat as Remat
from .plan import Replicated as Replicated
from .plan import RowParallel as RowParallel
from .plan import SequenceParallel as SequenceParallel
from .plan import Sharded as Sharded
from .plan import SplitSequence as SplitSequence
from .plan import Style as Style
from .plan import VocabParallel as VocabParallel
from .plan import parallelize as parallelize
from .plan import unparallelize as unparallelize
from .planning import Estimate as Estimate
from .planning import estimate as estimate
from .planning import search as search
from .precision import Precision as Precision
from .runtime import initialize as initialize
from .spmd import build_sharded as build_sharded
from .spmd import shard_map as shard_map

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_FSDP_MIN_SIZE_BYTES",
    "FSDP",
    "CheckReport",
    "ColumnParallel",
    "ContextParallel",
    "DataParallel",
    "DeclaresPartitionSpecs",
    "DeviceMesh",
    "Distribution",
    "Estimate",
    "ExpertParallel",
    "FeatureParallel",
    "HeadParallel",
    "LayoutMap",
    "ModelParallel",
    "ParityError",
    "Pipeline",
    "Precision",
    "Remat",
    "Replicated",
    "RowParallel",
    "SequenceParallel",
    "Sharded",
    "SplitSequence",
    "Style",
    "TensorLayout",
    "VocabParallel",
    "build_model",
    "build_sharded",
    "check",
    "checkpoint",
    "collectives",
    "context",
    "distribute_input",
    "distribute_model",
    "distribute_opt_state",
    "distribution",
    "estimate",
    "fsdp_spec",
    "initialize",
    "inspect",
    "leaf_paths",
    "list_devices",
    "named_shardings",
    "nn",
    "parallelize",
    "partition_specs",
    "pipeline",
    "placement",
    "planning",
    "precision",
    "ragged",
    "schedule",
    "search",
    "set_distribution",
    "shard_map",
    "unparallelize",
    "value_and_grad",
]
