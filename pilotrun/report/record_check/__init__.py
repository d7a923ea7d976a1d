"""Judging a run record: summarize, one session's events reconciled, the time split, interruptions,
evaluations against their checkpoints, a mixture's account and the spikes on the record."""
