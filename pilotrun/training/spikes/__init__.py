"""A loss spike, from its definition to its answer: the bound that says what a spike is (bound.py, torch-free,
also read by the report), the detector that watches each update (detector.py) and the rollback that answers
one from a committed checkpoint (rollback.py). What the record says of spikes afterwards is judged in
pilotrun/report/record_check/spike_history.py."""
