"""Simulation: one training iteration of a Plan on a cluster, as a discrete-event run.

`simulator.simulate` builds each layer's task graph (`layer_graph.py`) on the cluster's
links and NICs (`fabric.py`) and runs it on the event engine (`timeline.py`);
`comparison.compare` runs several planners on the same sampled batches.
"""

from ballonet.simulation.result import SimResult
from ballonet.simulation.simulator import simulate

__all__ = ["SimResult", "simulate"]
