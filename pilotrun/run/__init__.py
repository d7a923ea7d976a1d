"""The run folder's format, torch-free: the record, checkpoint markers, the frozen lock, recipe changes,
sinks."""
