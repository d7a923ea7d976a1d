"""Projecting and accounting: what the pilot predicts for a long run, the band of that prediction, and the
time ledger of a whole run."""
