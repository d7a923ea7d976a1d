"""The verdict and its rules: the rule table, the thresholds, and the judges of stability, resources,
evidence, continuity and downstream figures."""
