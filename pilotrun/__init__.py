"""pilotrun: a pilot-first pretraining system.

Folders, in the order data flows: `data/` (sources become token shards, read back with cursors),
`model/` (tokens become a loss), `optim/` (the loss becomes an update), `train/` (the loop, precision,
checkpoints and the run record), `report/` (a run becomes evidence: summarize and verdict).
"""

__version__ = "0.1.0"
