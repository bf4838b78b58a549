"""Pipeline parallelism as pure functions called inside `shard_map`.

Every device of the pipeline axis holds one stage (or, for the circular schedule, several)
and passes activations to the next device over a ring with `lax.ppermute`. All loops are one
`lax.scan` over clock steps, so the compiled program does not grow with the number of
microbatches. The functions here know nothing of Equinox modules beyond "a callable pytree";
`eqpar.nn.PipelineModule` wraps them.

- `execute_pipeline_step`: one clock step of the ring.
- `execute_pipeline`: the GPipe forward pass (differentiate through it for training).
- `execute_circular_pipeline`: the circular (interleaved) forward pass, several stages per
  device.
- `execute_schedule`: a whole training step (loss and gradients) in the order of any
  training schedule of `eqpar.schedule` (1F1B, zero-bubble ZB-H1, GPipe or circular with
  their backward): the one training executor. Every executor here runs the same loop
  (`_loop.py`), from the table its schedule gives. (`execute_1f1b`, deprecated, is
  `execute_schedule` with `OneFOneBSchedule`.)
- `Microbatched`: marks an extra stage argument (an attention mask, positions) as per-example,
  so that every stage call gets the rows of the microbatch it is working on.

The package's rooms: `_program.py` compiles a schedule table (`eqpar.schedule`) into the
per-step, per-device arrays the loop reads; `_loop.py` is the step loop; `_executors.py` the
public executors; `_microbatch.py` splits batches and per-example arguments; `_tools.py` keeps
replication types consistent through scans and switches; `_jaxpr.py` reads what a stage does.
"""

from ._executors import execute_1f1b as execute_1f1b
from ._executors import execute_circular_pipeline as execute_circular_pipeline
from ._executors import execute_pipeline as execute_pipeline
from ._executors import execute_pipeline_step as execute_pipeline_step
from ._executors import execute_schedule as execute_schedule
from ._microbatch import Microbatched as Microbatched

__all__ = [
    "Microbatched",
    "execute_1f1b",
    "execute_circular_pipeline",
    "execute_pipeline",
    "execute_pipeline_step",
    "execute_schedule",
]
